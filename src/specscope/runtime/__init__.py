"""What a decoding run is made of, below the models: the KV cache, sampling (+ params.py: the sampling limits the
CLI, the server and the library share) and the tokenizer. Nothing here imports a model or a decoding loop."""
