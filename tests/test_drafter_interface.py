"""The drafter seam (speculative/drafters.py): what a drafter must implement, batching asked of the drafter, the one
factory, and spawns that share what a server's drafter learns."""

from __future__ import annotations

import pytest
import torch

from specscope.runtime.sampling import SamplingParams
from specscope.speculative.budget import Prices
from specscope.speculative.decode import SpecConfig, drafter_for
from specscope.speculative.drafters import DraftModelDrafter, Drafter, Eagle3TreeDrafter, TreeDrafter, run_together
from specscope.speculative.hybrid import HybridDrafter, NgramDrafter, PricedDrafter
from test_spec_hybrid import CTX, eagle, target  # noqa: F401 (fixtures)

FLAT = Prices({1: 1.0, 16: 1.0}, 10.0)


def test_a_drafter_must_implement_drafting_and_its_state():
    """A subclass that implements nothing is refused when built (it used to build, and its propose and drafting
    called each other forever)."""
    class Nothing(Drafter):
        pass

    class NoForwards(TreeDrafter):
        def start(self, prompt_ids, root, target_out, max_len): ...
        def commit(self, rows, verify_out, new_tokens): ...
        def spawn(self): return NoForwards("cpu")

    with pytest.raises(TypeError, match="drafting"):
        Nothing()
    with pytest.raises(TypeError, match="_catch_up"):     # a tree drafter's forwards too
        NoForwards("cpu")


class Table(TreeDrafter):
    """A tree drafter whose logits come from a fixed table over the token expanded; drafters of one `key` run a
    round's forwards together (one by one here, counted)."""

    kind = "table"
    V = 10

    def __init__(self, key, rounds: list):
        super().__init__(torch.device("cpu"))
        self.key, self.rounds, self.root = key, rounds, 0
        self.table = torch.randn(self.V, self.V, generator=torch.Generator().manual_seed(5))

    def start(self, prompt_ids, root, target_out, max_len):
        self.root, self.root_pos = root, len(prompt_ids)

    def commit(self, rows, verify_out, new_tokens): ...

    def spawn(self):
        return Table(self.key, self.rounds)

    def _catch_up(self):
        return self.table[self.root], None

    def _expand(self, tokens, states, positions, slots, mask):
        return self.table[tokens], None

    def batch_key(self):
        return self.key

    def forwards_together(self, reqs):
        self.rounds.append(len(reqs))
        return super().forwards_together(reqs)


def test_run_together_batches_the_forwards_the_drafters_say_can_go_together():
    """run_together groups a round's forwards by the drafters' batch_key (None: alone), not by their class; every
    tree is the one its drafter drafts alone."""
    rounds: list = []
    ds = [Table("a", rounds), Table("a", rounds), Table(None, rounds), Table("b", rounds)]
    for i, d in enumerate(ds):
        d.start([1, 2, 3], 2 + i, None, 32)
    cfg = SpecConfig(3, 2, 6)
    trees = run_together([d.drafting(cfg, SamplingParams(), None) for d in ds])
    assert rounds == [2, 1] * cfg.steps       # "a" together, "b" on its own key, the None one never asked
    for d, t in zip(ds, trees):
        u = d.propose(cfg, SamplingParams(), None)
        assert t.tokens.tolist() == u.tokens.tolist() and t.parents.tolist() == u.parents.tolist()


def test_drafter_for_builds_a_loaded_network_as_build_drafter_does(target, eagle):
    """The factory's way in for a network already in hand (a training snapshot, check-drafter's): an EAGLE-3 head,
    a small model with the target's tokenizer, and either under the priced rule."""
    e, m = drafter_for(eagle, target), drafter_for(target, target)
    assert type(e) is Eagle3TreeDrafter and e.model is eagle and e.aux_layers == eagle.aux_layers
    assert type(m) is DraftModelDrafter and m.kind == "draft_model"
    p = drafter_for(eagle, target, FLAT)
    assert isinstance(p, HybridDrafter) and p.kind == "eagle3" and p.model_kind is None and p.source is None
    assert p.context == target.config.max_position_embeddings


def test_spawns_share_what_the_priced_rule_learned_and_start_fresh(target, eagle):
    """A spawn (one per sequence in a batch) shares its parent's prices and counts (a server's, not one
    request's), and keeps nothing of a sequence: its own model drafter and copy source."""
    for h in (HybridDrafter(Eagle3TreeDrafter(eagle, target), CTX, prices=FLAT, live=False),
              PricedDrafter(Eagle3TreeDrafter(eagle, target), CTX, FLAT)):
        s = h.spawn()
        assert type(s) is type(h) and (s.kind, s.model_kind, s.source_name) == (h.kind, h.model_kind, h.source_name)
        assert s.rule is h.rule and s.pricing is h.pricing and s.prices is h.prices
        assert s.drafter is not h.drafter and type(s.drafter) is type(h.drafter) and s.drafter.model is eagle
        assert (s.source is None) == (h.source is None) and (s.source is None or s.source is not h.source)
    n = NgramDrafter(target.device, prices=FLAT)
    s = n.spawn()
    assert s.pricing is n.pricing and s.copy_stats is n.copy_stats and s.source is not n.source
    assert NgramDrafter(target.device).spawn().pricing is None
