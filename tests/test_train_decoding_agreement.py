"""Training and decoding see the drafter the same way: on the tokens a real greedy decode produced, the first draft
token of every cycle equals the teacher-forced step-0 prediction (TTT row t = root position - 1) on that very
sequence, so real first-token acceptance equals teacher-forced acc_0 measured at the cycles' positions.

Any mismatch between how training unrolls the drafter and how `propose` runs it (features fed, positions, norms,
the draft-vocabulary map) breaks this equality. What remains between the trainer's held-out figures and real τ is
selection: cycles start right after a rejection, where drafting is harder than at an average position.
"""

import torch
from spec_helpers import random_eagle3, tiny_target

from specscope.generate import generate
from specscope.generate import speculative_generate
from specscope.speculative.decode import SpecConfig
from specscope.speculative.drafters import Eagle3TreeDrafter
from specscope.train.ttt import ttt_unroll

VOCAB = 24


class _Recording(Eagle3TreeDrafter):
    """Records (root position, first draft token) per cycle."""

    def __init__(self, drafter, target):
        super().__init__(drafter, target)
        self.firsts = []

    def drafting(self, cfg, sampling, gen, profiler=None):   # what the decoding loop drives
        tree = yield from super().drafting(cfg, sampling, gen, profiler)
        self.firsts.append((self.root_pos, int(tree.tokens[0])))
        return tree


def test_real_first_token_acceptance_equals_teacher_forced_acc0(tmp_path):
    target = tiny_target(tmp_path / "t", layers=4, vocab=VOCAB, max_position_embeddings=256)
    drafter = random_eagle3(target, seed=1, scale=2.0)
    g = torch.Generator().manual_seed(0)
    checked = accepted = 0
    for trial in range(4):
        prompt = torch.randint(0, VOCAB, (12,), generator=g).tolist()
        rec = _Recording(drafter, target)
        out = speculative_generate(target, rec, prompt, 60, cfg=SpecConfig.from_knobs(steps=3, topk=1))
        assert out.token_ids == generate(target, prompt, 60).token_ids          # lossless, as always
        seq = torch.tensor([prompt + out.token_ids])
        T = seq.shape[1]
        with torch.no_grad():
            fwd = target(seq, torch.arange(T)[None], aux_layers=drafter.aux_layers)
            aux = torch.stack(fwd.aux_hidden, dim=2)
            step0 = ttt_unroll(drafter, target.embed_tokens.weight, aux, seq, K=1)[0][0]   # [T, Vd]
        tf_pred = drafter.draft_to_target(step0.argmax(-1))                   # row t predicts token t+2
        for root_pos, first in rec.firsts:
            if root_pos + 1 >= T:
                continue                                                       # drafted past max-new-tokens
            assert first == int(tf_pred[root_pos - 1]), (trial, root_pos)
            checked += 1
            accepted += first == int(seq[0, root_pos + 1])
    # real acc_0 over these cycles is then, by the equality above, teacher-forced acc_0 at the same positions
    assert checked >= 100 and 0 < accepted < checked
