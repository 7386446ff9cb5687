"""Read what production engines print — SGLang scheduler lines, vLLM spec-decoding and throughput lines,
Prometheus scrapes — and specscope's own profile lines, into registry runs.

Files are streamed line by line (multi-GB logs, .gz too); lines that claim a format but do not parse (corrupt,
truncated, interleaved by concurrent writers) are counted and reported, never fatal. vLLM's torch-profiler traces
(`*.pt.trace.json[.gz]`, one JSON document) are read whole by `torch_trace` into per-phase cycle timing.
Entry point: `specscope.ingest.core.ingest_file`; one module per format.
"""
