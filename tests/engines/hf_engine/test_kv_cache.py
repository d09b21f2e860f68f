"""The transformers adapter (``lm_eval_safe/kv_cache.py``) and the guards that catch a cache API
misread on any supported transformers version.

The guards compare what the package computes through kept KV caches (a batch with rollbacks in
test_batching.py; here the prefix store and scoring contexts) against transformers' own forward
of each whole sequence *without* any cache. On transformers 4.57 an earlier version passed its
cache under a keyword that model did not declare, so every forward silently ran without its
past: these comparisons are what fails then. Float64, so only the logic can differ.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers import WORDS, completed_rows

from lm_eval_safe.decoder.batch_driver import gap_filling_order
from lm_eval_safe.engines import load_member
from lm_eval_safe.engines.base import Forward
from lm_eval_safe.engines.hf import kv_cache, model_calls, packed_slots
from lm_eval_safe.engines.hf.batch import MemberBatch
from lm_eval_safe.engines.hf.scoring import score_tokens


def _full_logprobs(member, ids: list[int]) -> torch.Tensor:
    """transformers' forward over the whole sequence, no cache: the independent reference."""
    with torch.inference_mode():
        logits = member.engine.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    return torch.log_softmax(logits[:, : len(member.vocab)].double(), dim=-1)


def _shared_prefix_prompts(member, n: int, seed: int) -> list[list[int]]:
    """Token ids of prompts that share a few-shot prefix of several store blocks."""
    rng = random.Random(seed)
    exemplars = " ".join(rng.choice(WORDS) for _ in range(60))
    texts = [f"{exemplars} Q: {' '.join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))}" for _ in range(n)]
    return [member.encode(t) for t in texts]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_prefix_store_rows_match_full_recompute(
    tiny_bpe_dir: Path, tiny_gemma_dir: Path, family: str
) -> None:
    """Prompts sharing exemplars go through one batch: each after the first starts from the
    prefix store's states, is spliced into its row, then decodes with rollbacks. Every returned
    distribution equals a cache-free forward of the row's whole sequence."""
    member = load_member(str(tiny_bpe_dir if family == "llama" else tiny_gemma_dir), dtype="float64")
    prompts = _shared_prefix_prompts(member, 4, seed=3)
    rng = random.Random(5)
    batch = MemberBatch(member)
    seqs: list[list[int]] = []
    checked = 0
    for prompt in prompts:
        row = batch.add_row()
        seqs.append([])
        call = Forward(0, 0, prompt, [len(prompt) - 1])
        out = completed_rows(batch, batch.run({row: call}), {row: call})
        seqs[row] = list(prompt)
        torch.testing.assert_close(out[row][0].double(), _full_logprobs(member, prompt)[-1], atol=1e-8, rtol=0)
        checked += 1
    store = member.engine.prefix_store
    assert store.reused_tokens >= 3 * store.block, "later prompts must start from the store"
    for _ in range(6):
        calls = {}
        for row, seq in enumerate(seqs):
            keep = len(seq) - rng.randint(0, 3)
            feed = [rng.randrange(3, len(member.vocab)) for _ in range(rng.randint(1, 4))]
            calls[row] = Forward(0, keep, feed, list(range(len(feed))))
        out = completed_rows(batch, batch.run(calls), calls)
        for row, call in calls.items():
            seqs[row] = seqs[row][: call.keep] + call.ids
            reference = _full_logprobs(member, seqs[row])
            for got, i in zip(out[row], call.want, strict=True):
                torch.testing.assert_close(got.double(), reference[call.keep + i], atol=1e-8, rtol=0)
                checked += 1
    assert checked > 60


@pytest.mark.parametrize("prefix_cache_mb", [0, 256])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_scored_continuations_match_full_recompute(
    tiny_bpe_dir: Path, tiny_gemma_dir: Path, family: str, prefix_cache_mb: int
) -> None:
    """Contexts of different lengths (left-padded in one batch), several multi-token choices
    per context (the context's cache copied to one row per choice), scored twice (the second
    time from the prefix store when it is on): each token's log-prob and argmax flag equal a
    cache-free forward of context + continuation. (The scorer keeps float32 log-probs, as lm-eval's
    ``hf`` does, so 1e-5 here; a forward without its past is off by nats.)"""
    member = load_member(
        str(tiny_bpe_dir if family == "llama" else tiny_gemma_dir),
        dtype="float64",
        prefix_cache_mb=prefix_cache_mb,
    )
    rng = random.Random(7)
    contexts = [ids for ids in _shared_prefix_prompts(member, 3, seed=11)]
    contexts.append(member.encode("the cat sat"))
    pairs = []
    for ctx in contexts:
        for _ in range(3):
            words = " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))
            pairs.append((ctx, member.encode(words, add_special_tokens=False)))
    assert len({len(c) for c, _ in pairs}) > 1 and max(len(x) for _, x in pairs) > 1
    for _ in range(2):
        scored = score_tokens(member.engine, pairs, 3, 64)
        for (ctx, cont), (lps, greedy) in zip(pairs, scored, strict=True):
            reference = _full_logprobs(member, ctx + cont)[len(ctx) - 1 : -1]
            expected = reference.gather(1, torch.tensor(cont)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(lps, dtype=torch.float64), expected, atol=1e-5, rtol=0)
            assert greedy == (reference.argmax(dim=1) == torch.tensor(cont)).tolist()
    if prefix_cache_mb:
        assert member.engine.prefix_store.reused_tokens > 0


# -- the adapter's own operations, against plain tensor arithmetic ----------------------------
def _states(rows: int, slots: int, layers: int = 2, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(rows, 2, slots, 3, generator=gen), torch.randn(rows, 2, slots, 3, generator=gen))
        for _ in range(layers)
    ]


def test_row_operations_equal_tensor_indexing() -> None:
    states = _states(3, 5)
    cache = kv_cache.new_cache(states)
    assert kv_cache.seq_length(cache) == 5
    picked = kv_cache.layer_states(kv_cache.select_rows(cache, [2, 0, 2]))
    for (k, v), (pk, pv) in zip(states, picked, strict=True):
        assert torch.equal(pk, k[[2, 0, 2]]) and torch.equal(pv, v[[2, 0, 2]])
    rows = packed_slots.pack_row_slots(cache, 1, 1, 4)
    for (k, v), (rk, rv) in zip(states, rows.layers(), strict=True):
        assert torch.equal(rk, k[1:2, :, 1:4]) and torch.equal(rv, v[1:2, :, 1:4])
    kv_cache.crop(cache, 2)
    assert kv_cache.seq_length(cache) == 2
    for (k, _), (ck, _) in zip(states, kv_cache.layer_states(cache), strict=True):
        assert torch.equal(ck, k[:, :, :2])


def test_packed_slots_copy_every_layer_and_join_along_the_slots() -> None:
    """Layers of two shapes (other head counts) and an empty layer: each group of equal tensors
    is one pack, the copies outlive writes to the cache, and joined chunks equal the slots they
    were cut from."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(2, 6, 5, 3), (2, 6, 5, 3), (2, 1, 5, 3)]
    states = [(torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)) for shape in shapes]
    cache = kv_cache.new_cache([states[0], None, states[1], states[2]])
    before = [(k.clone(), v.clone()) for k, v in states]
    first, second = packed_slots.pack_row_slots(cache, 1, 0, 2), packed_slots.pack_row_slots(cache, 1, 2, 5)
    assert len(first.packs) == 2 and first.layers()[1] is None
    assert first.nbytes == sum(k[1:2, :, :2].numel() * 8 for k, _ in before)
    for k, v in kv_cache.layer_states(cache)[::2] + kv_cache.layer_states(cache)[3:]:
        k.zero_(), v.zero_()
    joined = packed_slots.concat_slots([first, second])
    assert joined[1] is None
    for (k, v), got in zip(before, [joined[0], joined[2], joined[3]], strict=True):
        assert torch.equal(got[0], k[1:2, :, :5]) and torch.equal(got[1], v[1:2, :, :5])


def test_left_padded_stack() -> None:
    short, long = kv_cache.new_cache(_states(1, 2, seed=1)), kv_cache.new_cache(_states(1, 4, seed=2))
    stacked = kv_cache.layer_states(kv_cache.stack_left_padded([short, long], 4))
    for (k, _), (sk, _), (lk, _) in zip(
        stacked, kv_cache.layer_states(short), kv_cache.layer_states(long), strict=True
    ):
        assert torch.equal(k[0, :, 2:], sk[0]) and not k[0, :, :2].any()
        assert torch.equal(k[1], lk[0])


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_a_rows_view_forward_equals_the_rows_copied_out_and_back(
    tiny_bpe_dir: Path, tiny_gemma_dir: Path, family: str
) -> None:
    """A forward of some rows of a batch through rows_view (their slots gathered per layer, the
    new ones written into the batch's buffers) gives, bit for bit, the logits of the same
    forward on copies of those rows; afterwards the batch holds the new slots in those rows and
    zeros (holes) in the others, and every row's old slots as they were."""
    member = load_member(str(tiny_bpe_dir if family == "llama" else tiny_gemma_dir))
    model = member.engine.model
    rng = random.Random(11)
    rows, prompt, width = 4, 6, 3
    batch = kv_cache.new_cache()
    with torch.inference_mode():
        ids = torch.tensor([[rng.randrange(len(member.vocab)) for _ in range(prompt)] for _ in range(rows)])
        model_calls.run(model, batch, input_ids=ids)
        kv_cache.with_slots(batch, spare=2)  # the new slots outgrow the spare ones
        before = [(k.clone(), v.clone()) for k, v in kv_cache.layer_states(batch)]  # type: ignore[misc]
        chosen = [1, 3]
        copied = kv_cache.select_rows(batch, chosen)
        new_ids = torch.tensor([[rng.randrange(len(member.vocab)) for _ in range(width)] for _ in chosen])
        want = model_calls.run(model, copied, input_ids=new_ids).logits
        got = model_calls.run(model, kv_cache.rows_view(batch, chosen), input_ids=new_ids).logits
    assert torch.equal(want, got)
    for (k, v), (bk, bv), (ck, cv) in zip(
        kv_cache.layer_states(batch), before, kv_cache.layer_states(copied), strict=True
    ):
        assert k.shape[2] == prompt + width
        assert torch.equal(k[:, :, :prompt], bk) and torch.equal(v[:, :, :prompt], bv)
        assert torch.equal(k[chosen], ck) and torch.equal(v[chosen], cv)
        assert not k[[0, 2], :, prompt:].any() and not v[[0, 2], :, prompt:].any()


def test_layers_holding_nothing_survive_every_operation() -> None:
    """A layer that shares another's states (KV sharing) never fills its own: kept empty."""
    states = _states(2, 3)
    cache = kv_cache.new_cache([states[0], None, states[1]])
    assert [s is None for s in kv_cache.layer_states(cache)] == [False, True, False]
    picked = kv_cache.select_rows(cache, [1])
    assert [s is None for s in kv_cache.layer_states(picked)] == [False, True, False]
    assert kv_cache.seq_length(picked) == 3


def test_unknown_cache_layer_is_refused() -> None:
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = kv_cache.new_cache(_states(1, 2))
    cache.layers.append(DynamicSlidingWindowLayer(sliding_window=4))
    with pytest.raises(kv_cache.UnsupportedModelError, match="DynamicSlidingWindowLayer"):
        kv_cache.layer_states(cache)


def test_cache_keyword_comes_from_the_forward_signature() -> None:
    class Renamed(torch.nn.Module):  # transformers 5.x
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
            return cache

    class Legacy(torch.nn.Module):  # transformers 4.57, remote code
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return past_key_values

    class Neither(torch.nn.Module):
        def forward(self, input_ids=None, **kwargs):
            return None

    marker = object()
    assert model_calls.run(Renamed(), marker, input_ids=None) is marker
    assert model_calls.run(Legacy(), marker, input_ids=None) is marker
    with pytest.raises(kv_cache.UnsupportedModelError, match="neither cache= nor past_key_values="):
        model_calls.run(Neither(), marker, input_ids=None)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_slot_layers_give_the_cat_caches_logits_bitwise(
    tiny_bpe_dir: Path, tiny_gemma_dir: Path, family: str
) -> None:
    """A cache written in place (SlotLayer views over buffers with spare slots) feeds attention
    the same values as transformers' concatenated DynamicCache: float32 logits are equal bit
    for bit, through growth past the spare slots and a crop, so greedy texts cannot move."""
    member = load_member(str(tiny_bpe_dir if family == "llama" else tiny_gemma_dir))
    model = member.engine.model
    rng = random.Random(3)
    ids = [rng.randrange(len(member.vocab)) for _ in range(12)]
    plain, slots = kv_cache.new_cache(), kv_cache.new_cache()
    with torch.inference_mode():
        first = model_calls.run(model, plain, input_ids=torch.tensor([ids])).logits
        assert torch.equal(first, model_calls.run(model, slots, input_ids=torch.tensor([ids])).logits)
        kv_cache.with_slots(slots, spare=2)
        assert all(type(layer) is kv_cache.SlotLayer for layer in slots.layers)
        for step in range(7):  # past the 2 spare slots: the buffers are re-allocated
            if step == 4:
                kv_cache.crop(plain, 10)
                kv_cache.crop(slots, 10)
            token = torch.tensor([[rng.randrange(len(member.vocab))]])
            want = model_calls.run(model, plain, input_ids=token).logits
            got = model_calls.run(model, slots, input_ids=token).logits
            assert torch.equal(want, got), step
            assert kv_cache.seq_length(plain) == kv_cache.seq_length(slots)
    for mine, theirs in zip(kv_cache.layer_states(slots), kv_cache.layer_states(plain), strict=True):
        assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])


def test_slot_layer_row_and_slot_moves_equal_the_tensor_operations() -> None:
    """Rows added and dropped, slots widened on the left, compacted, cropped and appended, in
    place in a SlotLayer's buffers (growing past their spare rows and slots): its states
    equal the same operations done with torch.cat, index_select and gather on plain tensors,
    for keys and values alike."""
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)

    def states(rows: int, slots: int) -> torch.Tensor:
        return torch.randn(rows, 2, slots, 3, generator=gen)

    keys, values = states(1, 4), states(1, 4)
    cache = kv_cache.new_cache([(keys, values)])
    kv_cache.with_slots(cache, spare=2, rows=3)
    want = [keys.expand(3, -1, -1, -1).clone(), values.expand(3, -1, -1, -1).clone()]

    def check(step: str) -> None:
        ((got_keys, got_values),) = kv_cache.layer_states(cache)
        assert torch.equal(got_keys, want[0]) and torch.equal(got_values, want[1]), step

    check("with_slots")
    for step in range(40):
        rows, slots = want[0].shape[0], want[0].shape[2]
        move = rng.choice(["add", "keep", "widen", "compact", "crop", "append"])
        if move == "add" or rows == 1 and move == "keep":
            count = rng.randint(1, 3)
            kv_cache.add_rows(cache, count)
            want = [torch.cat([t, t.new_zeros((count, *t.shape[1:]))]) for t in want]
        elif move == "keep":
            # ascending, the batch driver's order (the last rows fill the gaps), or any order
            kept = sorted(rng.sample(range(rows), rng.randint(1, rows - 1)))
            order = rng.choice(["ascending", "gap filling", "shuffled"])
            if order == "gap filling":
                kept = gap_filling_order(kept)
            elif order == "shuffled":
                rng.shuffle(kept)
            kv_cache.keep_rows(cache, kept)
            want = [t[kept] for t in want]
        elif move == "widen":
            grow = rng.randint(1, 5)
            kv_cache.widen_left(cache, grow)
            want = [torch.cat([t.new_zeros((*t.shape[:2], grow, t.shape[3])), t], dim=2) for t in want]
        elif move == "compact":
            begin = rng.choice([0, rng.randint(0, slots - 1)])  # 0: every slot, into new buffers
            live = [sorted(rng.sample(range(begin, slots), rng.randint(0, slots - begin))) for _ in range(rows)]
            width = max(len(kept) for kept in live)
            kv_cache.compact_slots(cache, begin, live, width)
            compacted = []
            for t in want:  # brute force: each row's live slots one by one, zeros before them
                out = torch.cat([t[:, :, :begin], t.new_zeros((rows, t.shape[1], width, t.shape[3]))], dim=2)
                for row, kept in enumerate(live):
                    for i, slot in enumerate(kept):
                        out[row, :, begin + width - len(kept) + i] = t[row, :, slot]
                compacted.append(out)
            want = compacted
        elif move == "crop":
            keep = rng.randint(1, slots)
            kv_cache.crop(cache, keep)
            want = [t[:, :, :keep] for t in want]
        else:  # a forward's new slots, as transformers writes them
            width = rng.randint(1, 4)
            new = [states(rows, width), states(rows, width)]
            with torch.inference_mode():
                cache.layers[0].update(*new)
            want = [torch.cat([t, n], dim=2) for t, n in zip(want, new, strict=True)]
        check(f"{step}: {move}")
    assert kv_cache.seq_length(cache) == want[0].shape[2]


@pytest.mark.parametrize(
    "kept",
    [
        [0, 7, 2, 6, 4, 5],  # the batch driver's order: rows 6 and 7 fill the gaps 1 and 3
        [0, 1, 2, 3, 4],  # the last rows dropped: nothing moves
        [5, 4, 3, 2, 1, 0],  # reversed: sources and targets overlap
        [2, 0, 1, 6, 7],  # a rotation, and rows from past the kept ones
    ],
)
def test_keeping_more_than_half_the_rows_in_any_order_moves_them_in_place(kept: list[int]) -> None:
    """More than half the rows kept, listed in any order: row ``i`` holds what row ``kept[i]``
    held (indexing the plain tensors is the reference), in the same buffers."""
    gen = torch.Generator().manual_seed(9)
    keys, values = torch.randn(8, 2, 6, 3, generator=gen), torch.randn(8, 2, 6, 3, generator=gen)
    cache = kv_cache.new_cache([(keys, values)])
    kv_cache.with_slots(cache, spare=2)
    storage = cache.layers[0].keys.untyped_storage().data_ptr()
    kv_cache.keep_rows(cache, kept)
    ((held_keys, held_values),) = kv_cache.layer_states(cache)
    assert torch.equal(held_keys, keys[kept]) and torch.equal(held_values, values[kept])
    assert cache.layers[0].keys.untyped_storage().data_ptr() == storage


def test_slot_layer_gives_rows_back_and_refills_in_one_reallocation() -> None:
    """A batch's tail (half its rows or fewer left, none to admit) gives the finished rows'
    memory back; the requests that then refill it grow the buffers once, to the most rows held
    before, not once per admitted row; the states held stay as they were throughout."""
    gen = torch.Generator().manual_seed(7)
    keys, values = torch.randn(1, 2, 6, 3, generator=gen), torch.randn(1, 2, 6, 3, generator=gen)
    cache = kv_cache.new_cache([(keys, values)])
    kv_cache.with_slots(cache, spare=2, rows=8)

    def buffer_bytes() -> int:
        return cache.layers[0].keys.untyped_storage().nbytes()

    full = buffer_bytes()
    kv_cache.keep_rows(cache, [1, 6, 7])  # 3 of 8: 5 rows given back
    assert buffer_bytes() == full * 3 // 8
    ((held_keys, held_values),) = kv_cache.layer_states(cache)
    assert torch.equal(held_keys, keys.expand(3, -1, -1, -1))
    assert torch.equal(held_values, values.expand(3, -1, -1, -1))
    storages = set()
    for _ in range(5):  # the refill: one re-allocation, back to 8 rows
        kv_cache.add_rows(cache, 1)
        storages.add(cache.layers[0].keys.untyped_storage().data_ptr())
    assert len(storages) == 1 and buffer_bytes() == full
    ((held_keys, _),) = kv_cache.layer_states(cache)
    assert torch.equal(held_keys[:3], keys.expand(3, -1, -1, -1))
    assert not held_keys[3:].any()
    kv_cache.keep_rows(cache, [0, 1, 2, 3, 4])  # more than half kept: nothing moves
    assert buffer_bytes() == full


def test_a_batchs_first_prompt_fills_its_own_row_and_leaves_holes_of_zeros() -> None:
    """A batch's cache is made from its first prompt: that row holds the states, every other row
    zeros (finite holes the masks exclude), each layer with the spare slots asked for."""
    gen = torch.Generator().manual_seed(3)
    layers = [(torch.randn(1, 2, 5, 3, generator=gen), torch.randn(1, 2, 5, 3, generator=gen)) for _ in range(3)]
    cache = kv_cache.new_cache(layers)
    kv_cache.with_slots(cache, spare=4, rows=4, row=2)
    for (keys, values), (got_keys, got_values) in zip(layers, kv_cache.layer_states(cache), strict=True):
        for want, got in ((keys, got_keys), (values, got_values)):
            assert got.shape == (4, 2, 5, 3)
            assert torch.equal(got[2], want[0])
            assert not got[[0, 1, 3]].any()
            assert got.untyped_storage().nbytes() == 4 * 2 * (5 + 4) * 3 * got.element_size()
