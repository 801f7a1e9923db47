"""Hybrid and recurrent models (Qwen3.5/3.6: Gated DeltaNet + attention) and MTP heads: the rewind rules, the
header facts and memory they need, the refusals, and exactness on a tiny Qwen3.5-shaped pair through the real
llama.cpp (greedy output bit for bit plain decoding's, the target's distribution at T > 0, slots, prompt reuse)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from localspec.config import load_preset
from localspec.errors import RollbackError, UsageError
from localspec.models import memory
from localspec.rounds.engine import Engine
from localspec.rounds.events import TokenEvent, collect
from tests.helpers_fake import FakeModel
from tests.helpers_stats import chi_square, joint_probs

# One thread: a load skips the automatic choice's 0.2 s CPU sample, and two test workers never split a core.
GREEDY = load_preset("greedy").with_overrides(threads=1)


def preset_settings(**values: object) -> memory.Settings:
    """The default preset's estimate settings with these values (`memory.Settings.changed`)."""
    return memory.settings_from_preset(load_preset()).changed(**values)


def drafting(k: int, drafter: str = "model", adaptive: bool = False, p_min: float = 0.0):
    # (drafts every round: these tests look at drafts; standing aside: tests/test_stand_aside.py)
    return dataclasses.replace(GREEDY.draft, n_draft=k, drafter=drafter, adaptive=adaptive, p_min=p_min,
                               stand_aside=False)


def sampled(seed: int, temperature: float = 0.7, top_k: int = 40):
    return dataclasses.replace(load_preset("default").sampling, temperature=temperature, top_k=top_k, top_p=1.0,
                               seed=seed)


# -- the rewind rules, on the scripted fake (fast) ------------------------------------------------------------------


def fake_pair(depth: int | None, draft_depth: int | None, noise: float = 1.5) -> tuple[FakeModel, FakeModel]:
    return (FakeModel(vocab=8, rewind_depth=depth),
            FakeModel(vocab=8, noise=noise, rewind_depth=draft_depth))


@pytest.mark.parametrize("draft_depth", [None, 0])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_stays_plain_decoding_with_a_recurrent_target_and_draft(k: int, draft_depth: int | None) -> None:
    """A target that rewinds only within its last decode (k of them at most) and a draft that rewinds only to a
    checkpoint: the fakes refuse any other rewind and check every decode's position, so output equal to the
    table's own greedy continuation means every rewind and catch-up was right."""
    target, draft = fake_pair(6, draft_depth)
    engine = Engine(target, draft)
    reference = FakeModel(vocab=8)
    for seed in range(6):
        prompt = np.random.default_rng(seed).integers(0, 8, size=5).tolist()
        for drafter in ("model", "lookup", "chain"):
            got = collect(engine.generate(prompt, GREEDY.sampling, drafting(k, drafter), 40)).tokens
            assert got == reference.greedy(prompt, 40), (seed, drafter)
    assert draft_depth is None or draft.restores > 0  # the draft went back to its checkpoints


def test_a_draft_longer_than_the_target_rewinds_is_refused_before_anything_runs() -> None:
    target, draft = fake_pair(4, 0)
    engine = Engine(target, draft)
    with pytest.raises(RollbackError, match="rolls back at most 4 tokens"):
        engine.start([1, 2, 3], GREEDY.sampling, drafting(5), 10)
    assert not target.cells  # nothing was decoded
    engine.start([1, 2, 3], GREEDY.sampling, drafting(4), 10)  # within the depth: fine
    engine.start([1, 2, 3], GREEDY.sampling, drafting(0), 10, slot=0)  # plain decoding needs no rewind


def test_a_next_prompt_goes_back_to_the_checkpoint_at_the_last_prompt_end() -> None:
    """A chat's next turn shares the last prompt (not the reply's cells, which the template rewrites): a recurrent
    target comes back to the checkpoint taken where the prompt ended instead of decoding it all again."""
    target, draft = fake_pair(6, 0)
    engine = Engine(target, draft)
    first = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    done = collect(engine.generate(first, GREEDY.sampling, drafting(3), 12))
    second = [*first, 3, 3, 3]  # not the reply: its cells cannot be kept, the prompt's can
    stream = engine.start(second, GREEDY.sampling, drafting(3), 12)
    assert stream.stats.prompt_tokens_processed == len(second) - len(first)
    assert done.tokens and collect_stream(engine, stream) == FakeModel(vocab=8).greedy(second, 12)


def collect_stream(engine: Engine, stream) -> list[int]:
    out = []
    while not stream.finished:
        engine.step([stream])
        out += [e.token for e in stream.events() if isinstance(e, TokenEvent)]
    return out


def test_several_slots_with_a_recurrent_target_are_each_what_they_are_alone() -> None:
    target, draft = (FakeModel(vocab=8, n_seq=3, rewind_depth=5),
                     FakeModel(vocab=8, noise=1.5, n_seq=3, rewind_depth=0))
    engine = Engine(target, draft)
    prompts = [np.random.default_rng(s).integers(0, 8, size=4 + s).tolist() for s in range(3)]
    streams = [engine.start(p, GREEDY.sampling, drafting(k), 30, slot=i)
               for i, (p, k) in enumerate(zip(prompts, (5, 2, 0), strict=True))]
    outs: list[list[int]] = [[] for _ in streams]
    while not all(s.finished for s in streams):
        engine.step(streams)
        for out, s in zip(outs, streams, strict=True):
            out += [e.token for e in s.events() if isinstance(e, TokenEvent)]
    reference = FakeModel(vocab=8)
    assert outs == [reference.greedy(p, 30) for p in prompts]


# -- header facts, memory, refusals (no weights) -----------------------------------------------------------------------


def test_header_facts_of_a_hybrid_with_an_mtp_block(hybrid_pair) -> None:
    from localspec.models.gguf_header import read_header

    target, draft = (read_header(p) for p in hybrid_pair)
    assert target.nextn_layers == 1 and target.trunk_layers == 4 and draft.nextn_layers == 0
    rec = target.recurrence
    assert rec is not None and rec.kind == "hybrid" and rec.rolls_back
    assert rec.layers == (0, 2) and target.attention_layers == (1, 3)
    # Per Gated DeltaNet layer: (conv 4 - 1) x (inner 64 + 2 x 2 groups x 16) + 16 x 64 floats.
    assert rec.state_bytes == 2 * (3 * (64 + 64) + 16 * 64) * 4


def test_memory_counts_attention_kv_and_the_recurrent_state(hybrid_pair) -> None:
    from localspec.models import memory
    from localspec.models.gguf_header import read_header

    target = read_header(hybrid_pair[0])
    s = preset_settings(n_ctx=1024, n_draft=6)
    m = memory.model_memory(target, s, n_outputs=7, n_gpu_layers=-1, snapshots=6)
    # Two attention layers of 2 KV heads x (32 + 32), f16, 1024 cells; the MTP block and recurrent layers none.
    assert m.kv == 2 * 2 * 64 * 1024 * 2
    assert m.state == target.recurrence.state_bytes * (1 + 6 + 1)
    mtp = memory.model_memory(target, s.changed(drafter="mtp"), n_outputs=7, n_gpu_layers=-1, mtp=True)
    assert mtp.kv == m.kv * 3 // 2  # its own context: the MTP block's attention too


def qwen36_27b_header(tmp_path):
    """A header with Qwen3.6-27B's text hyperparameters (its config.json as llama.cpp's converter writes it)."""
    from localspec.models.gguf_header import read_header
    from tests import helpers_gguf as G
    from tests.helpers_vocab import write_vocab

    base = write_vocab(tmp_path / "base.gguf", arch="qwen35", hparams={
        "block_count": 65, "embedding_length": 5120, "head_count": 24, "head_count_kv": 4, "context_length": 262144})
    keys = {"attention.key_length": 256, "attention.value_length": 256, "nextn_predict_layers": 1,
            "full_attention_interval": 4, "ssm.conv_kernel": 4, "ssm.inner_size": 6144, "ssm.state_size": 128,
            "ssm.group_count": 16, "ssm.time_step_rank": 48}
    records = {f"qwen35.{k}": G.kv(f"qwen35.{k}", G.UINT32, v) for k, v in keys.items()}
    return read_header(G.rewrite(base, tmp_path / "qwen36-27b.gguf", records))


def test_qwen3_6_27b_state_and_kv(tmp_path) -> None:
    """The arithmetic behind models.toml's 27B lines: 48 Gated DeltaNet layers of (4 - 1) x (6144 + 2 x 16 x 128)
    convolution and 128 x 6144 state floats (llama.cpp's n_embd_r, n_embd_s); KV in the 16 attention layers only,
    4 KV heads of 256; the MTP block's own KV in the MTP context."""
    from localspec.models import memory

    h = qwen36_27b_header(tmp_path)
    rec = h.recurrence
    assert rec is not None and len(rec.layers) == 48 and rec.rolls_back
    assert rec.state_bytes == 48 * (3 * (6144 + 4096) + 128 * 6144) * 4 == 156_893_184  # 149.6 MiB
    assert h.attention_layers == tuple(range(3, 64, 4))
    assert memory.kv_bytes(h, 8192, "q8_0") == 16 * 4 * 512 * 8192 * 34 // 32  # 272 MiB
    s = preset_settings(n_ctx=8192, n_draft=3, kv_type="q8_0", drafter="mtp")
    m = memory.model_memory(h, s, n_outputs=4, n_gpu_layers=-1, mtp=True, snapshots=3)
    assert m.kv == 17 * 4 * 512 * 8192 * 34 // 32
    assert m.state == 156_893_184 * 5  # the state, 3 snapshots, the checkpoint


def _qwen36_header(name: str, arch: str, n_layer: int, n_embd: int, n_head: int, n_kv: int, ssm: tuple[int, int],
                   nextn: int, weights: int):
    """Header facts of a Qwen3.5/3.6 GGUF (models.toml's config.json facts: heads of 256, linear attention heads of
    128, a full-attention layer every 4, 248320 tokens); the weights as one tensor of the listed bytes."""
    from localspec.models.gguf_header import GGUFHeader, StringArray, TensorInfo

    a = arch
    meta = {"general.architecture": a, f"{a}.block_count": n_layer + nextn, f"{a}.attention.head_count": n_head,
            f"{a}.attention.head_count_kv": n_kv, f"{a}.attention.key_length": 256,
            f"{a}.attention.value_length": 256, f"{a}.embedding_length": n_embd, f"{a}.context_length": 262144,
            f"{a}.full_attention_interval": 4, f"{a}.ssm.conv_kernel": 4, f"{a}.ssm.inner_size": ssm[1] * 128,
            f"{a}.ssm.state_size": 128, f"{a}.ssm.group_count": ssm[0], f"{a}.ssm.time_step_rank": ssm[1],
            f"{a}.nextn_predict_layers": nextn,
            "tokenizer.ggml.tokens": StringArray(b"", np.zeros(248320, dtype=np.int64))}
    return GGUFHeader(Path(name), 3, meta, (TensorInfo("weights", (weights,), 0, 0, weights),), 0, weights, 0)


def test_the_qwen3_6_pairs_fit_a_24_gb_card() -> None:
    """The 24 GB lines written in models.toml, from the estimator (a card with 23.5 GiB free, 5% kept back)."""
    from localspec.models import memory, registry
    from tests.test_memory import CARD_24GB, GiB

    pairs = registry.load_pairs()
    t27m = _qwen36_header("27b-mtp", "qwen35", 64, 5120, 24, 4, (16, 48), 1, int(17.1e9))
    t27 = _qwen36_header("27b", "qwen35", 64, 5120, 24, 4, (16, 48), 0, pairs["qwen3.6-27b"].target.size)
    d08 = _qwen36_header("0.8b", "qwen35", 24, 1024, 8, 2, (16, 16), 0, pairs["qwen3.6-27b"].draft.size)
    t35 = _qwen36_header("35b", "qwen35moe", 40, 2048, 16, 2, (16, 32), 0, 20_408_576_512)
    expect = {"qwen3.6-27b-mtp": (t27m, None, 18.4, 19.3), "qwen3.6-27b": (t27, d08, 19.4, 20.4),
              "qwen3.6-35b-a3b": (t35, d08, 21.8, 22.2)}
    for name, (t, d, at_ctx, at_32k) in expect.items():
        pair = pairs[name]
        s = preset_settings(n_ctx=pair.n_ctx, n_draft=pair.n_draft, kv_type=pair.kv_type,
                            drafter=pair.drafter or "model")
        est = memory.estimate(t, d, s, CARD_24GB)
        assert est.fits and round(est.gpu_bytes / GiB, 1) == at_ctx, (name, est.gpu_bytes / GiB)
        wide = memory.estimate(t, d, s.changed(n_ctx=32768), CARD_24GB)
        assert wide.fits and round(wide.gpu_bytes / GiB, 1) == at_32k, (name, wide.gpu_bytes / GiB)
    assert not memory.estimate(t35, d08, preset_settings(n_ctx=32768, n_draft=4, kv_type="f16"), CARD_24GB).fits


def test_check_says_what_each_model_of_a_hybrid_pair_is(hybrid_pair) -> None:
    """`localspec check`'s lines for a hybrid pair: the target's MTP layer and both models' recurrent layers
    (the draft's one in the singular), each rolled back for speculation."""
    from localspec.models.doctor import drafting_facts
    from localspec.models.gguf_header import read_header

    target = [text for _, text in drafting_facts(read_header(hybrid_pair[0]))]
    draft = [text for _, text in drafting_facts(read_header(hybrid_pair[1]), role="draft")]
    assert target[0].startswith("1 MTP layer (nextn_predict_layers)")
    assert "(qwen35: 2 recurrent layers, " in target[1] and "rolls it back for speculation" in target[1]
    assert draft == [next(t for t in draft if "(qwen35: 1 recurrent layer, " in t)]


def test_check_drafting_refuses_what_cannot_speculate(hybrid_pair, tiny_pair, monkeypatch) -> None:
    from localspec.llama import recurrent
    from localspec.models.gguf_header import read_header
    from localspec.sessions.session import check_drafting

    hybrid, plain = read_header(hybrid_pair[0]), read_header(tiny_pair[0])
    spec = GREEDY.with_overrides(n_draft=4)
    check_drafting(hybrid, read_header(hybrid_pair[1]), spec)  # fine with this llama-cpp-python
    check_drafting(hybrid, None, spec.with_overrides(drafter="mtp"))
    check_drafting(plain, None, spec.with_overrides(drafter="mtp"))  # refused by Engine.check_drafter, as every drafter
    monkeypatch.setattr(recurrent, "rollback_unsupported", lambda: "llama-cpp-python 0.3.2 cannot roll back")
    with pytest.raises(RollbackError, match="is a hybrid model: llama-cpp-python 0.3.2 cannot roll back"):
        check_drafting(hybrid, None, spec)
    check_drafting(hybrid, None, spec.with_overrides(n_draft=0))  # plain decoding needs no rollback
    check_drafting(plain, read_header(tiny_pair[1]), spec)  # an attention-only pair does not care


def test_an_architecture_without_snapshots_is_refused(hybrid_pair, tmp_path) -> None:
    """llama.cpp keeps no snapshots for qwen3next: speculation there is refused in one line."""
    from localspec.models.gguf_header import read_header
    from localspec.sessions.session import check_drafting
    from tests.helpers_vocab import write_vocab

    path = write_vocab(tmp_path / "next.gguf", arch="qwen3next", hparams={"block_count": 4})
    header = read_header(path)
    assert header.recurrence is not None and not header.recurrence.rolls_back
    with pytest.raises(RollbackError, match="cannot roll back a qwen3next model's recurrent state"):
        check_drafting(header, None, GREEDY.with_overrides(n_draft=3))


# -- through the real llama.cpp -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hybrid_session(hybrid_pair, tmp_path_factory):
    """The tiny hybrid pair, its target's MTP head reading the hidden state a little (mtp_noise 0.1): at T > 0
    both drafters' proposals draft_ahead the target's candidates partly (accepted, and resampled)."""
    from synthetic import HYBRID_TINY, write_hybrid_model

    from localspec.sessions.session import ModelFiles, open_session

    target = tmp_path_factory.mktemp("mtp-mid") / "target.gguf"
    write_hybrid_model(target, dataclasses.replace(HYBRID_TINY, mtp_noise=0.1), "target")
    with open_session(ModelFiles(target, hybrid_pair[1], "hybrid"),
                      GREEDY.with_overrides(n_draft=6, n_ctx=1024, threads=1)) as s:
        yield s


def prompts(n: int, seed: int = 7, length: int = 12) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, 40_000, size=length).tolist() for _ in range(n)]


@pytest.mark.slow
def test_the_context_params_struct_matches_the_library(hybrid_pair) -> None:
    """llama-cpp-python's declaration of n_rs_seq (and ctx_type, load_mtp) reaches llama.cpp: a context made with
    them reads them back, and an MTP context (which needs both other fields) runs."""
    import llama_cpp

    from localspec.llama.model import LlamaModel
    from localspec.llama.mtp_head import MtpHead

    for depth in (3, 7):
        with LlamaModel(hybrid_pair[0], n_ctx=256, device_top_k=0, n_threads=1, rewind=depth) as m:
            assert llama_cpp.llama_n_rs_seq(m.ctx) == depth == m.rewind_depth
            assert m.mtp_layers == 1
            head = MtpHead(m, n_ctx=256, n_threads=1)
            row = np.zeros(head.n_embd, dtype=np.float32)
            (scores, hidden), = head.decode([(0, 5, 0, row, True)])
            logits = scores.logits[0]
            assert logits.shape == (m.n_vocab,) and hidden.shape == (head.n_embd,) and np.isfinite(logits).all()
            head.close()


def head_entries(target, tokens: list[int]) -> list[tuple]:
    """A head's entries for `tokens` (sequence 0): each token with the target's hidden row before it (zeros first),
    the last one scored."""
    target.want_hidden(0, True)
    h = target.decode(tokens, 0, all_logits=True).hidden
    zeros = np.zeros(h.shape[1], dtype=np.float32)
    return [(0, tokens[p], p, zeros if p == 0 else h[p - 1], p == len(tokens) - 1) for p in range(len(tokens))]


@pytest.mark.slow
def test_the_heads_hidden_row_is_its_scored_entrys_in_a_batch_too(hybrid_pair) -> None:
    """A head decode of several entries, the last scored, hands back the last entry's own hidden state (what the
    next chained step reads), as decoding the others first and the last alone does. (llama.cpp's "masked" rows
    give the batch's first row there: docs/upstream.md.)"""
    from localspec.llama.model import LlamaModel
    from localspec.llama.mtp_head import MtpHead

    with LlamaModel(hybrid_pair[0], n_ctx=256, device_top_k=0, n_threads=1, rewind=3) as m:
        entries = head_entries(m, prompts(1, seed=5, length=6)[0])
        head = MtpHead(m, n_ctx=256, n_threads=1)
        (batched_logits, batched), = head.decode(entries)
        head.clear()
        head.decode([(*e[:4], False) for e in entries[:-1]])
        (alone_logits, alone), = head.decode(entries[-1:])
        head.clear()
        (_, first), = head.decode([(*entries[0][:4], True)])
        head.close()
    assert np.allclose(batched, alone, atol=1e-4)
    assert np.allclose(batched_logits.logits, alone_logits.logits, atol=1e-3)
    assert not np.allclose(batched, first, atol=1e-2)


@pytest.mark.slow
def test_the_heads_device_rows_are_the_top_of_its_full_rows(hybrid_pair) -> None:
    """With a device chain on its sequence, a head's scored row comes back as the top candidates of the row it
    gives without one (same ids, same logits: the CPU computes both alike), or its argmax; a head of several
    sequences keeps full rows (its later steps leave sequences out: docs/upstream.md's plan reuse)."""
    from localspec.llama.model import LlamaModel
    from localspec.llama.mtp_head import MtpHead

    with LlamaModel(hybrid_pair[0], n_ctx=256, device_top_k=0, n_threads=1, rewind=3) as m:
        entries = head_entries(m, prompts(1, seed=6, length=7)[0])
        rows = {}
        for mode in (None, "top_k", "greedy"):
            head = MtpHead(m, n_ctx=256, n_threads=1, device_top_k=16)
            assert head.use_sampler(mode, 0) is (mode is not None) and head.device_top_k == 16
            (rows[mode], _), = head.decode(entries)
            head.close()
        several = MtpHead(m, n_ctx=256, n_threads=1, n_seq=2, device_top_k=16)
        assert several.device_top_k == 0 and not several.use_sampler("top_k", 0)
        several.close()
    full = rows[None].logits[0]
    assert rows[None].ids is None and full.shape == (m.n_vocab,)
    top = rows["top_k"]
    assert top.ids.shape == (1, 16) and set(top.ids[0].tolist()) == set(np.argsort(-full)[:16].tolist())
    assert np.array_equal(top.logits[0], full[top.ids[0]])
    assert rows["greedy"].ids[0, 0] == int(np.argmax(full))


@pytest.mark.slow
def test_the_mtp_drafter_samples_the_same_from_device_rows_as_from_full_rows(hybrid_pair) -> None:
    """At T = 0.7 (top_k 40 within the device's 64) the head's steps read the device's candidates (on a GPU: the
    target here is taken for one before its head is made), and each seed's generation (drafts, acceptances, text) is
    the one the head and target give reading full rows. On the CPU the head reads full rows."""
    from localspec.sessions.session import ModelFiles, open_session

    files = ModelFiles(hybrid_pair[0], None, "hybrid")
    prompt = prompts(1, seed=31, length=10)[0]
    runs = {}
    for top_k in (64, 0):
        preset = GREEDY.with_overrides(n_draft=3, n_ctx=512, threads=1, drafter="mtp", device_top_k=top_k)
        with open_session(files, preset) as s:
            if top_k:
                cpu = s.engine.drafters["mtp"].head
                assert cpu.device_top_k == 0 and cpu._samplers is None  # (the CPU's rule)
                s.engine.drafters["mtp"].close()
                s.target.on_gpu = True
            out = []
            for seed in range(6):
                done = collect(s.engine.generate(prompt, sampled(seed), drafting(3, "mtp"), 24))
                out.append((done.tokens, done.stats.drafted, done.stats.accepted))
            head = s.engine.drafters["mtp"].head
            runs[top_k] = (out, head.device_top_k, head._samplers.modes.get(0) if head._samplers else None)
    assert runs[64][1:] == (64, "top_k") and runs[0][1:] == (0, None)
    assert runs[64][0] == runs[0][0] and sum(d for _, d, _ in runs[0][0]) > 0


@pytest.mark.slow
def test_the_mtp_drafter_prices_its_own_drafts(hybrid_session) -> None:
    """Its cost rule lives in its own file (`mtp.MtpCost`): the stream's cost model counts the head's acceptance under
    a source of its own and measures its steps, and adaptive k is chosen by the head's prices: the second epoch
    drafts k_max / 2 (the verify line's second width), then a length the head's measured costs choose."""
    from localspec.drafters.mtp import MtpCost

    s = hybrid_session
    s.engine.reset()
    d = drafting(6, "mtp", adaptive=True)
    done = collect(s.engine.generate(prompts(1, seed=37, length=10)[0], GREEDY.sampling, d, 96))
    policy = next(p for slot in s.engine.slots for (kept, _), p in slot.policies.items() if kept == d)
    assert isinstance(policy.pricing, MtpCost) and policy.adaptive
    cost = policy.cost
    assert set(cost.seen) == {"mtp"} and cost.seen["mtp"] > 0 and cost.step_s is not None and cost.step_s > 0
    assert policy.rounds > policy.EPOCH and policy.k != 6, (policy.rounds, policy.k)  # (k_max / 2 in epoch 2)
    assert done.stats.drafted > 0


@pytest.mark.slow
def test_mtp_drafts_are_the_heads_chain_over_the_targets_rows(hybrid_session, monkeypatch) -> None:
    """Every round's drafts at T = 0 are what the head gives fed the final sequence's own target rows, one entry a
    step as llama.cpp's draft-mtp feeds it: the first draft from (cur, the target's row before it), each next from
    (the last draft, the head's own row)."""
    from localspec.drafters import mtp
    from localspec.llama.mtp_head import MtpHead

    s = hybrid_session
    log: list[tuple[list[int], list[int]]] = []
    real = mtp.MtpDrafter.draft

    def draft(self, jobs):
        out = real(self, jobs)
        log.extend((list(req.tokens), list(p.tokens)) for (req, _), p in zip(jobs, out, strict=True))
        return out

    monkeypatch.setattr(mtp.MtpDrafter, "draft", draft)
    s.engine.reset()
    prompt = prompts(1, seed=29, length=10)[0]
    done = collect(s.engine.generate(prompt, GREEDY.sampling, drafting(3, "mtp"), 48))
    assert 0 < done.stats.accepted < done.stats.drafted
    full = prompt + done.tokens
    t = s.target
    s.engine.reset()
    t.want_hidden(0, True)
    h = t.decode(full, 0, all_logits=True).hidden
    t.want_hidden(0, False)
    s.engine.reset()
    zeros = np.zeros(h.shape[1], dtype=np.float32)
    head = MtpHead(t, n_ctx=256, n_threads=1)
    rounds = 0
    for tokens, drafts in log:
        if not drafts:
            continue
        cur = len(tokens) - 1
        head.clear()
        head.decode([(0, full[p], p, zeros if p == 0 else h[p - 1], False) for p in range(cur)])
        (row, own), = head.decode([(0, full[cur], cur, h[cur - 1], True)])
        chain = [int(np.argmax(row.logits[0]))]
        while len(chain) < len(drafts):
            (row, own), = head.decode([(0, chain[-1], cur + len(chain), own, True)])
            chain.append(int(np.argmax(row.logits[0])))
        assert drafts == chain, (cur, drafts, chain)
        rounds += 1
    head.close()
    assert rounds > 5


@pytest.mark.slow
def test_truncate_rewinds_exactly_or_says_how_far_it_went(hybrid_pair) -> None:
    """Within the last decode: bit for bit a fresh context's logits. Past it (where llama.cpp's own seq_rm says yes
    and is wrong): back to the checkpoint, or to nothing, and the re-decoded logits are again a fresh context's."""
    from localspec.llama.model import LlamaModel

    tokens = prompts(1, seed=3, length=30)[0]
    with LlamaModel(hybrid_pair[0], n_ctx=256, device_top_k=0, n_threads=1, rewind=6) as fresh:
        ref = fresh.decode(tokens, 0, all_logits=True).logits.copy()
    with LlamaModel(hybrid_pair[0], n_ctx=256, device_top_k=0, n_threads=1, rewind=6) as m:
        m.decode(tokens[:20], 0)
        m.decode(tokens[20:26], 20)
        assert m.truncate(23) == 23  # 3 of the last decode's 6
        assert np.array_equal(m.decode(tokens[23:25], 23, all_logits=True).logits, ref[23:25])
        assert m.truncate(24) == 24  # 1 of the last decode's 2
        m.checkpoint()  # at 24
        for i in range(24, 27):
            m.decode([tokens[i]], i)  # one-token decodes: no snapshot can undo them
        assert m.truncate(26) == 24  # back to the checkpoint
        assert np.array_equal(m.decode(tokens[24:28], 24, all_logits=True).logits, ref[24:28])
        assert m.truncate(10) == 0  # before the checkpoint: nothing kept
        assert np.array_equal(m.decode(tokens[:12], 0, all_logits=True).logits, ref[:12])


@pytest.mark.slow
def test_a_restored_state_forgets_the_snapshots_and_checkpoint_of_the_cells_it_replaced(hybrid_pair) -> None:
    """load_state (the prompt cache, slot files) replaces a sequence's cells: a rewind afterwards must not use the
    replaced cells' last decode (llama.cpp's snapshots) or their checkpoint; it goes to nothing, and the
    re-decoded logits are a fresh context's."""
    from localspec.llama.model import LlamaModel

    a, b = prompts(2, seed=5, length=30)
    with LlamaModel(hybrid_pair[0], n_ctx=256, device_top_k=0, n_threads=1, rewind=6) as fresh:
        ref = fresh.decode(b, 0, all_logits=True).logits.copy()
        saved_b = fresh.save_state(0)
    with LlamaModel(hybrid_pair[0], n_ctx=256, device_top_k=0, n_threads=1, rewind=6) as m:
        m.decode(a[:20], 0)
        m.checkpoint()  # at 20: a's
        m.decode(a[20:25], 20)  # a last decode of 5: a's snapshots
        assert m.load_state(saved_b, 0)
        assert m.truncate(25) == 0  # neither a's snapshots nor a's checkpoint at 20
        assert np.array_equal(m.decode(b[:27], 0, all_logits=True).logits, ref[:27])


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["hybrid_pair", "hybrid_pair_high", "hybrid_moe_pair"])
def test_greedy_with_every_drafter_is_plain_decoding_bit_for_bit(request, pair) -> None:
    """The draft model (itself hybrid), prompt lookup, the chain and the target's MTP head, at several lengths,
    fixed and adaptive: the tokens plain greedy decoding gives. Prompts repeat a phrase (lookup matches). On the
    mixture-of-experts hybrid too: a verify's tokens each pick their own experts."""
    from localspec.sessions.session import ModelFiles, open_session

    files = request.getfixturevalue(pair)
    with open_session(ModelFiles(files[0], files[1], "hybrid"),
                      GREEDY.with_overrides(n_draft=6, n_ctx=1024, threads=1)) as s:
        drafted = accepted = 0
        for base in prompts(3, seed=11, length=8):
            prompt = base + base
            plain = collect(s.engine.generate(prompt, GREEDY.sampling, drafting(0), 48)).tokens
            for d in (drafting(1, "mtp"), drafting(3, "mtp"), drafting(6, "mtp"), drafting(6, "mtp", adaptive=True),
                      drafting(2), drafting(6), drafting(6, "lookup"), drafting(6, "chain"),
                      drafting(6, "mtp", p_min=0.5), drafting(6, "chain-mtp"),
                      dataclasses.replace(drafting(4, "chain-mtp"), chain_lead="suffix")):
                done = collect(s.engine.generate(prompt, GREEDY.sampling, d, 48))
                assert done.tokens == plain, (d.drafter, d.n_draft)
                if d.drafter == "mtp":
                    drafted, accepted = drafted + done.stats.drafted, accepted + done.stats.accepted
    assert drafted > 0 and accepted > 0
    if pair != "hybrid_pair_high":
        assert accepted < drafted  # rejections: the rewinds ran
    else:
        assert accepted > 0.9 * drafted  # the all-accepted path


@pytest.mark.slow
@pytest.mark.parametrize("rows", ["full", "device"])
def test_constrained_greedy_with_every_drafter_is_constrained_plain_decoding(hybrid_pair, rows) -> None:
    """A JSON schema and a GBNF grammar on the hybrid target: each drafter's constrained greedy text is constrained
    plain decoding's, token for token. With `constrained_rows = "device"` too: a recurrent target reads its
    constrained rows whole (it cannot go back into a verify to decode one row again)."""
    from localspec.rounds.constraints import Constraint
    from localspec.sessions.session import ModelFiles, open_session

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    constraints = [Constraint.json_schema(schema, "test"), Constraint('root ::= [a-z]+ "."', "letters")]
    with open_session(ModelFiles(hybrid_pair[0], hybrid_pair[1], "hybrid"),
                      GREEDY.with_overrides(n_draft=6, n_ctx=1024, threads=1, constrained_rows=rows)) as s:
        drafted = 0
        for constraint, prompt in zip(constraints, prompts(2, seed=31, length=10), strict=True):
            plain = collect(s.engine.generate(prompt, GREEDY.sampling, drafting(0), 32,
                                              grammar=constraint.grammar(s.target))).tokens
            for d in (drafting(3, "mtp"), drafting(6), drafting(6, "chain")):
                done = collect(s.engine.generate(prompt, GREEDY.sampling, d, 32,
                                                 grammar=constraint.grammar(s.target)))
                assert done.tokens == plain, (constraint.source, d.drafter)
                drafted += done.stats.drafted
    assert drafted > 0


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["model", "mtp"])
def test_a_next_prompt_reuses_the_cached_prompt_and_stays_exact(hybrid_pair, drafter) -> None:
    """A chat's next turn: the new prompt extends the last one (not its reply). The recurrent target goes back to
    its checkpoint at the last prompt's end and the MTP head to its row there, so only the new tokens are decoded,
    and the output is what a fresh engine gives."""
    from localspec.sessions.session import ModelFiles, open_session

    first = prompts(1, seed=13, length=16)[0]
    second = [*first, *prompts(1, seed=14, length=5)[0]]
    files = ModelFiles(hybrid_pair[0], hybrid_pair[1], "hybrid")
    preset = GREEDY.with_overrides(n_draft=4, n_ctx=512, threads=1)
    with open_session(files, preset) as fresh:
        expected = collect(fresh.engine.generate(second, GREEDY.sampling, drafting(4, drafter), 24)).tokens
    with open_session(files, preset) as s:
        collect(s.engine.generate(first, GREEDY.sampling, drafting(4, drafter), 24))
        stream = s.engine.start(second, GREEDY.sampling, drafting(4, drafter), 24)
        assert stream.stats.prompt_tokens_processed == len(second) - len(first)
        out = []
        while not stream.finished:
            s.engine.step([stream])
            out += [e.token for e in stream.events() if isinstance(e, TokenEvent)]
    assert out == expected


@pytest.mark.slow
def test_the_heads_cells_saved_and_loaded_score_as_before(hybrid_pair) -> None:
    """The MTP head's cells through llama.cpp's sequence state (what the prompt cache keeps of it): loaded into
    another sequence, and back into a cleared one, the next entry scores bit for bit as on the cells that were
    saved; a state llama.cpp refuses leaves the sequence empty and says so."""
    from localspec.llama.model import LlamaModel
    from localspec.llama.mtp_head import MtpHead

    tokens = prompts(1, seed=6, length=8)[0]
    with LlamaModel(hybrid_pair[0], n_ctx=256, device_top_k=0, n_threads=1, rewind=3, n_seq=2) as m:
        m.want_hidden(0, True)
        h = m.decode(tokens, 0, all_logits=True).hidden
        zeros = np.zeros(h.shape[1], dtype=np.float32)
        entries = [(0, tokens[p], p, zeros if p == 0 else h[p - 1], False) for p in range(7)]
        head = MtpHead(m, n_ctx=256, n_threads=1, n_seq=2)
        try:
            head.decode(entries)
            saved = head.save_state(0)
            last = (tokens[7], 7, h[6], True)
            (expected, expected_row), = head.decode([(0, *last)])
            assert head.load_state(saved, 1)
            (other, other_row), = head.decode([(1, *last)])
            head.clear(0)
            assert head.load_state(saved, 0)
            (again, _), = head.decode([(0, *last)])
            assert not head.load_state(bytearray(b"not a state"), 1)
            (empty, _), = head.decode([(1, tokens[0], 0, zeros, True)])  # (position 0 again: the sequence is empty)
        finally:
            head.close()
    assert np.array_equal(expected.logits, other.logits) and np.array_equal(expected_row, other_row)
    assert np.array_equal(expected.logits, again.logits)
    assert not np.array_equal(expected.logits, empty.logits)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["model", "mtp", "chain-mtp"])
def test_two_conversations_through_the_prompt_cache_stay_exact(hybrid_pair, drafter) -> None:
    """Two conversations take turns on one slot with the prompt cache: each turn restores the hybrid target's state
    (and the draft's, or the MTP head's cells with the target rows it holds) from host RAM, so only the new text is
    read, and every reply is what a fresh engine gives, drafts included (a head restored wrong would draft
    otherwise: exact output alone cannot tell)."""
    from localspec.sessions.session import ModelFiles, open_session

    files = ModelFiles(hybrid_pair[0], hybrid_pair[1], "hybrid")
    preset = GREEDY.with_overrides(n_draft=4, n_ctx=512, threads=1)
    history = {0: prompts(1, seed=21, length=14)[0], 1: prompts(1, seed=22, length=14)[0]}
    with open_session(files, preset, prompt_cache=True) as cached, open_session(files, preset) as fresh:
        for turn_no in range(2):
            for who in (0, 1):
                p = history[who]
                got = collect(cached.engine.generate(p, GREEDY.sampling, drafting(4, drafter), 12))
                fresh.engine.reset()
                ref = collect(fresh.engine.generate(p, GREEDY.sampling, drafting(4, drafter), 12))
                assert got.tokens == ref.tokens
                assert (got.stats.drafted, got.stats.accepted) == (ref.stats.drafted, ref.stats.accepted)
                if turn_no:
                    assert got.stats.prompt_tokens_processed == 3  # restored: only the new text is read
                history[who] = [*p, *got.tokens, *prompts(1, seed=30 + who, length=3)[0]]
        assert cached.engine.prompt_cache.counters().hits == 2  # type: ignore[union-attr]


@pytest.mark.slow
def test_a_slot_file_keeps_the_mtp_heads_part_and_refuses_one_that_does_not_fit(hybrid_pair, tmp_path) -> None:
    """A slot file of a hybrid target drafting with its MTP head holds the head's cells and the target rows it
    drafts from: restored into another engine, the next turn reads only its new text and drafts as a fresh engine
    does. A head's part whose tokens are not the slot's, or of another width, is refused in one line before any
    cell changes; a file without it (format 1, or a state without the head) is restored and the head reads again."""
    from localspec.rounds import slot_file
    from localspec.rounds.prompt_cache import SeqFile
    from localspec.rounds.slot_file import SlotFileError
    from localspec.sessions.session import ModelFiles, open_session

    files = ModelFiles(hybrid_pair[0], None, "hybrid")
    preset = GREEDY.with_overrides(n_draft=4, n_ctx=512, threads=1, drafter="mtp")
    first = prompts(1, seed=41, length=14)[0]
    path = tmp_path / "mtp.slot"
    with open_session(files, preset) as s:
        reply = collect(s.engine.generate(first, GREEDY.sampling, drafting(4, "mtp"), 12)).tokens
        state = s.engine.snapshot(0)
        assert state.drafters and any(d is not None for d in state.drafters)
        slot_file.write(path, state, [slot_file.identity(m) for m in s.engine.state_models()])
    follow = [*first, *reply, *prompts(1, seed=42, length=3)[0]]
    with open_session(files, preset) as fresh:
        ref = collect(fresh.engine.generate(follow, GREEDY.sampling, drafting(4, "mtp"), 12))
    with open_session(files, preset) as s:
        identities = [slot_file.identity(m) for m in s.engine.state_models()]
        loaded = slot_file.read(path, identities, n_vocab=s.target.n_vocab, n_ctx=s.engine.n_ctx)
        (part,) = loaded.parts
        bad_tokens = SeqFile(part.kind, part.meta, (part.blobs[0], bytearray(len(part.blobs[1])), *part.blobs[2:]))
        bad_width = SeqFile(part.kind, {**part.meta, "width": part.meta["width"] + 1}, part.blobs)
        for bad, message in ((bad_tokens, "the head's tokens are not the slot's"), (bad_width, "wide")):
            with pytest.raises(SlotFileError, match=f"mtp drafter's part does not fit: .*{message}"):
                s.engine.restore(0, loaded.state, [bad])
        assert s.engine.slots[0].target_kv == []  # (refused before any cell changed)
        assert s.engine.restore(0, loaded.state, loaded.parts)
        got = collect(s.engine.generate(follow, GREEDY.sampling, drafting(4, "mtp"), 12))
        assert got.tokens == ref.tokens and got.stats.prompt_tokens_processed == 3
        assert (got.stats.drafted, got.stats.accepted) == (ref.stats.drafted, ref.stats.accepted)
        s.engine.reset()
        assert s.engine.restore(0, loaded.state, [])  # without the head's part: the head reads again, exact
        again = collect(s.engine.generate(follow, GREEDY.sampling, drafting(4, "mtp"), 12))
        assert again.tokens == ref.tokens and again.stats.prompt_tokens_processed == len(follow) - 1


@pytest.mark.slow
def test_a_served_slot_file_keeps_the_mtp_heads_part(hybrid_pair, tmp_path) -> None:
    """`localspec serve --drafter mtp` on the hybrid target, over HTTP: a slot saved and restored brings the MTP
    head's part back, so the next prompt that extends it reads only its new tokens (`timings.prompt_n`); a file
    whose head's part does not fit is a 400 naming the file and the part, and the slot keeps what it held."""
    import httpx

    from tests.test_serve import Server
    from tests.test_slot_file import rewrite_header

    saves = tmp_path / "saves"
    first = prompts(1, seed=61, length=20)[0]
    server = Server(tmp_path / "home", tmp_path, "--target", str(hybrid_pair[0]), "--drafter", "mtp", "--threads",
                    "1", "--ctx", "512", "--slot-save-path", str(saves))
    try:
        def complete(prompt: list[int]) -> dict:
            r = httpx.post(f"{server.root}/completion", json={"prompt": prompt, "n_predict": 1, "temperature": 0,
                                                              "id_slot": 0}, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()

        complete(first)  # (one token: the slot's cells hold the prompt, the hybrid's state at exactly its length)
        r = httpx.post(f"{server.root}/slots/0?action=save", json={"filename": "mtp.bin"}, timeout=300)
        assert r.status_code == 200, r.text
        complete(prompts(1, seed=62, length=20)[0])  # another conversation takes the slot
        good = (saves / "mtp.bin").read_bytes()
        wider = lambda h: h["drafters"][0]["meta"].update(width=h["drafters"][0]["meta"]["width"] + 1)  # noqa: E731
        rewrite_header(saves / "mtp.bin", wider, seal=True)  # (the checksum passes: the head's own check refuses it)
        r = httpx.post(f"{server.root}/slots/0?action=restore", json={"filename": "mtp.bin"}, timeout=300)
        assert r.status_code == 400 and r.json()["error"]["param"] == "filename", r.text
        assert "mtp.bin: its mtp drafter's part does not fit: width" in r.json()["error"]["message"], r.text
        (saves / "mtp.bin").write_bytes(good)
        r = httpx.post(f"{server.root}/slots/0?action=restore", json={"filename": "mtp.bin"}, timeout=300)
        assert r.status_code == 200, r.text
        follow = complete([*first, *prompts(1, seed=63, length=4)[0]])
        assert follow["timings"]["prompt_n"] == 4, follow["timings"]  # the head's part came back: no re-read
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize(("lengths", "drafters"), [((6, 3, 0, 5), ("model", "mtp", "model", "mtp")),
                                                   ((0, 3, 0, 5), ("model", "mtp", "model", "mtp")),
                                                   ((6, 3, 4, 5), ("chain-mtp", "mtp", "chain-mtp", "model"))],
                         ids=["drafting", "two-plain", "chain-mtp"])
@pytest.mark.parametrize("pair", ["hybrid_pair", "hybrid_moe_pair"])
def test_greedy_slots_together_are_each_what_it_is_alone(request, pair, lengths, drafters) -> None:
    """"two-plain": slots 2 and 3 verify one token each, so they would share a ubatch while slot 0's verify rolls
    back: llama.cpp's cell re-ordering lost slot 0's snapshots there (the canary below). "chain-mtp": the
    lookup-or-MTP chain beside the head alone and the draft model, on prompts that repeat (lookup matches). The
    mixture-of-experts hybrid: several sequences' tokens routed in one call are each routed as alone."""
    from localspec.sessions.session import ModelFiles, open_session
    from tests.helpers_rounds import each_alone, run_together

    hybrid_pair = request.getfixturevalue(pair)
    repeat = 2 if "chain-mtp" in drafters else 1
    reqs = [dict(prompt=p * repeat, sampling=GREEDY.sampling, drafting=drafting(k, d), max_tokens=20 + 3 * i)
            for i, (p, k, d) in enumerate(zip(prompts(4, seed=5), lengths, drafters, strict=True))]
    files = ModelFiles(hybrid_pair[0], hybrid_pair[1], "hybrid")
    preset = GREEDY.with_overrides(n_draft=6, n_ctx=512, threads=1)
    with open_session(files, preset) as alone:
        expected = each_alone(alone.engine, reqs)
    with open_session(files, preset, parallel=4) as s:
        assert run_together(s.engine, reqs, [0, 0, 1, 3], slots=[2, 0, 3, 1]) == expected


def target_next_probs(s, sampling):
    """The target's own next-token distribution under `sampling` after a context, from full logits: the reference
    the chi-square tests compare the speculative stream with."""
    def next_probs(context: list[int]) -> dict[int, float]:
        from localspec.rounds.sampling import candidates

        s.target.clear(0)
        s.target.use_device_sampler(None)  # the reference p comes from full logits
        p = candidates(s.target.decode(context, 0).logits, sampling)
        return dict(zip(p.ids[0].tolist(), p.probs[0].tolist(), strict=True))

    return next_probs


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["model", "mtp"])
def test_sampling_keeps_the_target_distribution(hybrid_session, drafter) -> None:
    """The joint distribution of the first two emitted tokens (both from one speculative round, through its
    rejections and the rewind) is the target's own, by chi-square at p = 0.001."""
    s = hybrid_session
    prompt = prompts(1, seed=23, length=6)[0]
    sampling = sampled(0, temperature=1.5, top_k=4)
    s.engine.reset()
    joint = joint_probs(target_next_probs(s, sampling), prompt, 2)
    s.engine.reset()
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(1600):
        for slot in s.engine.slots:  # a fresh cost model: it drafts whatever it measured (not by timing)
            slot.policies.clear()
        done = collect(s.engine.generate(prompt, dataclasses.replace(sampling, seed=seed), drafting(3, drafter), 2))
        counts[tuple(done.tokens)] += 1
        drafted, accepted = drafted + done.stats.drafted, accepted + done.stats.accepted
    assert 0 < accepted < drafted
    assert chi_square(counts, joint) < 37.7  # 15 degrees of freedom at p = 0.001


@pytest.mark.slow
def test_lookup_or_the_mtp_head_keeps_the_target_distribution(hybrid_session) -> None:
    """The lookup-or-MTP chain at T > 0: a prompt whose end repeats its start, one draft a round, three tokens: the
    first round is lookup's point mass; where it is rejected the context no longer repeats and the next round is the
    head's draw. The joint distribution of the three emitted tokens is the target's own (chi-square at p = 0.001),
    and both sources drafted."""
    s = hybrid_session
    base = prompts(1, seed=29, length=6)[0]
    prompt = base + base[:3]
    sampling = sampled(0, temperature=1.5, top_k=3)
    s.engine.reset()
    joint = joint_probs(target_next_probs(s, sampling), prompt, 3)
    s.engine.reset()
    counts: Counter = Counter()
    seen: Counter = Counter()
    d = drafting(1, "chain-mtp")
    for seed in range(1600):
        for slot in s.engine.slots:  # a fresh cost model each time
            slot.policies.clear()
        done = collect(s.engine.generate(prompt, dataclasses.replace(sampling, seed=seed), d, 3))
        counts[tuple(done.tokens)] += 1
        policy = next(p for slot in s.engine.slots for (kept, _), p in slot.policies.items() if kept == d)
        seen.update(policy.cost.seen)
    assert seen["lookup"] > 0 and seen["mtp"] > 0, seen
    assert len(joint) == 27 and chi_square(counts, joint) < 54.05  # 26 degrees of freedom at p = 0.001


@pytest.mark.slow
def test_lookup_or_the_mtp_head_takes_the_match_where_it_pays_and_the_head_between(hybrid_session) -> None:
    """Greedy, a prompt that repeats a phrase: the rounds that quote it are lookup's, the rest the head's (the cost
    model counts both sources), no round carries both (the head cannot draft after unverified tokens), the head
    drafts at most `mtp_n_draft` while lookup proposes up to `n_draft`, and the text is plain decoding's."""
    s = hybrid_session
    s.engine.reset()
    base = prompts(1, seed=41, length=10)[0]
    prompt = base + base + base[:4]
    plain = collect(s.engine.generate(prompt, GREEDY.sampling, drafting(0), 40)).tokens
    d = dataclasses.replace(drafting(6, "chain-mtp"), mtp_n_draft=2)
    rounds: list = []
    drafter = s.engine.drafters["chain-mtp"]
    real_draft = drafter.draft

    def recording(jobs):
        out = real_draft(jobs)
        rounds.extend(out)
        return out

    drafter.draft = recording
    try:
        done = collect(s.engine.generate(prompt, GREEDY.sampling, d, 40))
    finally:
        del drafter.draft
    assert done.tokens == plain
    policy = next(p for slot in s.engine.slots for (kept, _), p in slot.policies.items() if kept == d)
    assert policy.cost.seen["lookup"] > 0 and policy.cost.seen["mtp"] > 0, policy.cost.seen
    assert any(r.lead for r in rounds) and any(r.tokens and not r.lead for r in rounds)
    assert all(r.lead in (0, len(r.tokens)) for r in rounds)
    # The lead may propose the round's whole length, the head at most its own cap (mtp_n_draft).
    assert max(r.lead for r in rounds) > 2 and max(len(r.tokens) for r in rounds if not r.lead) <= 2


def test_mtp_without_mtp_layers_is_refused_as_every_drafter_the_models_cannot_run() -> None:
    """Engine.check_drafter, the one refusal of a drafter the models cannot run: it says why (the target's missing
    MTP layers) and names those they can run, before anything is decoded."""
    target, draft = fake_pair(None, None)
    for d, can in ((draft, "lookup, model, suffix, chain"), (None, "lookup, suffix")):
        engine = Engine(target, d)
        with pytest.raises(UsageError) as err:
            engine.start([1, 2, 3], GREEDY.sampling, drafting(4, "mtp"), 8)
        assert str(err.value) == (
            "drafter 'mtp' cannot run with these models (the target has no MTP layers: its GGUF has no "
            f"nextn_predict_layers; an MTP GGUF of the model has them); they can run: {can} (or draft length 0: "
            "plain decoding)")
        assert target.decodes == 0
        engine.check_drafter(drafting(0, "mtp"))  # plain decoding needs no drafter


def test_mtp_on_a_model_without_mtp_layers_is_one_line_and_exit_2(tiny_pair) -> None:
    """Through the engine's check, before any prompt is decoded: one line, exit 2."""
    from tests.test_bench_cli import localspec

    for drafter in ("mtp", "chain-mtp"):  # (the lookup-or-MTP chain needs the head too)
        r = localspec("bench", "--target", str(tiny_pair[0]), "--drafter", drafter, "--threads", "1")
        assert r.returncode == 2, r.stderr
        assert r.stderr.strip().splitlines() == [
            f"localspec: error: drafter '{drafter}' cannot run with these models ({tiny_pair[0].name} has no MTP "
            "layers: its GGUF has no nextn_predict_layers; an MTP GGUF of the model has them); they can run: lookup, "
            "suffix (or draft length 0: plain decoding)"]


@pytest.mark.slow
def test_bench_runs_speculative_with_rollback_on_a_hybrid_target(hybrid_pair, tmp_path) -> None:
    """`localspec bench` on a hybrid target with its MTP head: speculative rounds with rejections, greedy
    identical (the bench's own check)."""
    import json

    from typer.testing import CliRunner

    from localspec.cli.app import app

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "--target", str(hybrid_pair[0]), "--drafter", "mtp", "--threads",
                                      "1", "--repeat", "1", "--warmup", "0", "--max-tokens", "32", "--always-draft",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["greedy_check"]["passed"] is True, report["greedy_check"]
    assert 0 < report["speculative"]["acceptance_rate"] < 1


def test_check_reports_mtp_layers_and_the_recurrent_state(hybrid_pair) -> None:
    from typer.testing import CliRunner

    from localspec.cli.app import app

    result = CliRunner().invoke(app, ["check", str(hybrid_pair[0])], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "1 MTP layer" in result.output and "--drafter mtp" in result.output
    assert "is a hybrid model" in result.output and "rolls it back" in result.output
    result = CliRunner().invoke(app, ["check", str(hybrid_pair[1])], env={"COLUMNS": "200"})
    assert "no MTP layers" in result.output


@pytest.mark.slow
def test_a_hybrid_without_an_attention_layer_is_refused_before_llama_cpp_aborts_on_it(tmp_path) -> None:
    """llama.cpp aborts the process on the first decode of a Gated DeltaNet hybrid whose layers are all recurrent
    (its graph lacks the KV inputs: GGML_ASSERT(buffer) in set_inputs); the header check refuses it first, with one
    line naming the file, exit 2. The file: a two-block hybrid target, attention every 4th block (none)."""
    import os
    import subprocess
    import sys

    from synthetic import HYBRID_TINY, write_hybrid_model

    tiny = HYBRID_TINY.target
    spec = dataclasses.replace(HYBRID_TINY, target=dataclasses.replace(tiny, n_blocks=2, nextn=0,
                                                                       full_attention_interval=4),
                               draft_blocks=4, shared_blocks=1)
    crafted = tmp_path / "all-recurrent.gguf"
    write_hybrid_model(crafted, spec, "target")
    cli = [sys.executable, "-c", "from localspec.cli.app import main; main()"]
    done = subprocess.run([*cli, "generate", "hi", "--target", str(crafted), "--draft", "0", "--max-tokens", "2",
                           "--threads", "1"], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "LOCALSPEC_DEBUG"})
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(crafted) in lines[0] and "none of its 2 layers attends" in lines[0], lines


def test_a_pair_without_a_draft_names_a_drafter_that_needs_none(tmp_path) -> None:
    from localspec.errors import ConfigError
    from localspec.models import registry

    body = ('[[pair]]\nname = "p"\ndescription = "d"\nn_ctx = 4096\nn_draft = 3\n{extra}'
            '[pair.target]\nrepo = "a/b"\nfile = "t.gguf"\nquant = "Q4_K_M"\nfamily = "qwen3.5"\nlicense = "x"\n')
    path = tmp_path / "models.toml"
    path.write_text(body.format(extra='drafter = "mtp"\n'))
    (pair,) = registry.parse_file(path)
    assert pair.draft is None and pair.drafter == "mtp"
    path.write_text(body.format(extra=""))
    free = r"drafter = 'chain-mtp' or 'lookup' or 'mtp' or 'suffix'"
    with pytest.raises(ConfigError, match=r"models.toml:1: missing key 'draft' .*" + free):
        registry.parse_file(path)
    path.write_text(body.format(extra='drafter = "eagle"\n'))
    with pytest.raises(ConfigError, match="drafter = 'eagle': choose one of"):
        registry.parse_file(path)



# -- the server ---------------------------------------------------------------------------------------------------


def test_speculative_type_mtp_selects_the_mtp_drafter() -> None:
    from localspec.server.schema import ChatRequest, parse

    body = {"messages": [{"role": "user", "content": "hi"}]}
    for kind in ("mtp", "draft-mtp"):
        req = parse(ChatRequest, {**body, "speculative": {"type": kind, "n_max": 3}})
        assert req.preset_overrides()["drafter"] == "mtp"
    for kind in ("chain-mtp", "ngram-simple,draft-mtp"):
        req = parse(ChatRequest, {**body, "speculative": {"type": kind, "n_max": 3}})
        assert req.preset_overrides()["drafter"] == "chain-mtp"


@pytest.mark.slow
def test_the_server_drafts_with_the_mtp_head_and_refuses_what_it_cannot(hybrid_pair, tiny_pair, tmp_path) -> None:
    """On a hybrid target with an MTP head, `speculative.type: "mtp"` gives plain greedy decoding's text; a draft
    longer than the target rolls back, and MTP on a model without an MTP head, are a 400 naming why."""
    import openai

    from tests.test_serve import Server

    home = tmp_path / "home"
    home.mkdir()
    s = Server(home, tmp_path, "--target", str(hybrid_pair[0]), "--draft", "4", "--threads", "1")
    try:
        client = s.client()

        def complete(**extra: object) -> str:
            r = client.completions.create(model="target", prompt="Once upon a time", max_tokens=24, temperature=0,
                                          extra_body=extra)
            return r.choices[0].text

        assert complete(**{"speculative.type": "mtp"}) == complete(**{"speculative.type": "none"})
        with pytest.raises(openai.BadRequestError, match="rolls back at most 4 tokens"):
            complete(**{"speculative.type": "mtp", "speculative.n_max": 6})
    finally:
        s.stop()
    s = Server(home, tmp_path, "--target", str(tiny_pair[0]), "--threads", "1")
    try:
        for spelling in ("mtp", "draft-mtp"):
            with pytest.raises(openai.BadRequestError) as err:
                s.client().completions.create(model="target", prompt="Once", max_tokens=4,
                                              extra_body={"speculative.type": spelling})
            assert err.value.status_code == 400 and err.value.body["param"] == "speculative.type"  # type: ignore[index]
            assert err.value.body["message"] == (  # type: ignore[index]
                f"speculative.type: 'draft-mtp' (drafter 'mtp') is not available: {tiny_pair[0].name} has no MTP "
                "layers: its GGUF has no nextn_predict_layers; an MTP GGUF of the model has them; this server can "
                "run ngram-simple (lookup), suffix, none")
    finally:
        s.stop()


# -- a pair without a draft model: pull, list, resolve, check ---------------------------------------------------------

MTP_PAIR = """
[[pair]]
name = "hyb-mtp"
description = "a hybrid target with its own MTP head"
drafter = "mtp"
n_ctx = 1024
n_draft = 3

[pair.target]
repo = "org/hyb-target"
file = "target.gguf"
quant = "Q4_0"
family = "test"
license = "mit"
"""


def test_a_pair_with_its_own_mtp_head_pulls_one_file_and_resolves_to_the_mtp_drafter(hybrid_pair, tmp_path,
                                                                                     monkeypatch) -> None:
    from typer.testing import CliRunner

    from localspec.cli.app import app
    from localspec.models import registry
    from localspec.sessions import session
    from tests.helpers_hub import FakeHub, HubFile

    home = tmp_path / "home"
    home.mkdir()
    (home / "models.toml").write_text(MTP_PAIR)
    hub = FakeHub().start()
    hub.files[("org/hyb-target", "target.gguf")] = HubFile(hybrid_pair[0].read_bytes())
    for key, value in {"LOCALSPEC_HOME": str(home), "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"),
                       "HF_HUB_CACHE": str(tmp_path / "hf" / "hub"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    runner = CliRunner()
    try:
        result = runner.invoke(app, ["pull", "hyb-mtp", "--yes"])
        assert result.exit_code == 0, result.output
        assert len(hub.gets("target.gguf")) == 1 and registry.default_pair_name() == "hyb-mtp"
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        files = session.resolve_files(None, None, None)
        assert files.draft is None and files.drafter == "mtp"
        preset = session.settle_preset(load_preset("default"), files)
        assert preset.draft.drafter == "mtp" and preset.draft.n_draft == 3
        listing = runner.invoke(app, ["models"], env={"COLUMNS": "200"})
        assert "+ its own mtp drafter" in listing.output and "downloaded" in listing.output
        check = runner.invoke(app, ["check", "--pair", "hyb-mtp"], env={"COLUMNS": "200"})
        assert check.exit_code == 0 and "1 MTP layer" in check.output
    finally:
        hub.stop()


@pytest.mark.slow
def test_a_head_sitting_rounds_out_keeps_a_bounded_number_of_target_rows(hybrid_pair_high, monkeypatch) -> None:
    """Rounds with k = 0 (adaptive k judging the head a loss) hand the MTP drafter a target row per token; it keeps
    at most ROWS_HELD of them (it reads them where they would pile up), and drafts as well when it comes back:
    output plain decoding's, its drafts mostly accepted."""
    from localspec.drafters import mtp
    from localspec.rounds.policies import DraftLength
    from localspec.sessions.session import ModelFiles, open_session

    held: list[int] = []
    accept, next_k = mtp.MtpDrafter.accept, DraftLength.next
    rounds = {"n": 0}

    def counting_accept(self, req, proposal, accepted):  # type: ignore[no-untyped-def]
        accept(self, req, proposal, accepted)
        held.append(len(self._seqs[req.seq].rows))

    def sits_out_then_drafts(self):  # type: ignore[no-untyped-def]
        rounds["n"] += 1
        return 0 if rounds["n"] <= 150 else next_k(self)

    monkeypatch.setattr(mtp.MtpDrafter, "accept", counting_accept)
    with open_session(ModelFiles(hybrid_pair_high[0], hybrid_pair_high[1], "hybrid"),
                      GREEDY.with_overrides(n_draft=4, n_ctx=512, threads=1)) as s:
        prompt = prompts(1, seed=9, length=10)[0]
        plain = collect(s.engine.generate(prompt, GREEDY.sampling, drafting(0), 200)).tokens
        monkeypatch.setattr(DraftLength, "next", sits_out_then_drafts)
        spec = collect(s.engine.generate(prompt, GREEDY.sampling, drafting(4, "mtp"), 200))
    assert spec.tokens == plain
    assert len(held) > 150 and max(held) <= mtp.ROWS_HELD
    assert spec.stats.drafted > 0 and spec.stats.acceptance_rate > 0.8


def test_the_mtp_drafter_refuses_to_read_a_target_row_it_does_not_hold() -> None:
    """`_pairs` needs the target's row before each position it decodes; one outside what it holds is an error
    naming the position, never another row (a negative index read one from the end)."""
    from localspec.config import load_preset
    from localspec.drafters.base import DraftRequest
    from localspec.drafters.mtp import MtpDrafter, _Seq
    from localspec.errors import DecodeError
    from localspec.rounds.events import GenerationStats

    drafter = MtpDrafter(FakeModel(vocab=8))
    req = DraftRequest(0, [1, 2, 3, 4, 5, 6], GREEDY.sampling, load_preset("greedy").draft, GenerationStats())
    rows = [np.full(4, float(p), dtype=np.float32) for p in range(3, 5)]  # the target's rows at positions 3 and 4
    drafter._seqs[0] = _Seq(tokens=[1, 2, 3, 4], rows=list(rows), rows_from=3)
    assert [int(e[3][0]) for e in drafter._pairs(req, 5)] == [3, 4]  # positions 4 and 5 read rows 3 and 4
    drafter._seqs[0] = _Seq(tokens=[1, 2], rows=list(rows), rows_from=3)  # position 2 needs row 1: not held
    with pytest.raises(DecodeError, match="needs the target's hidden state at position 1 and holds positions 3..4"):
        drafter._pairs(req, 5)
    drafter._seqs[0] = _Seq(tokens=[1, 2, 3, 4], rows=list(rows), rows_from=3)
    with pytest.raises(DecodeError, match="at position 5 and holds positions 3..4"):
        drafter._pairs(req, 6)


def _rolled_back_row(path: Path, n_seq: int, grouped: bool = False) -> np.ndarray:
    """Sequence 0 verifies four tokens, rolls one back and decodes on; with n_seq = 4, sequences 2 and 3 (whose
    cells llama.cpp gave out before and after sequence 0's) each decode one token after its verify in the same
    `decode_many`: one ubatch of both with `grouped`, else one call each (what `ubatch.whole_plan` does where a
    state keeps rollback snapshots)."""
    import llama_cpp

    from localspec.llama import ubatch
    from localspec.llama.model import LlamaModel

    first = [5, 9, 12, 40, 7, 3, 22, 18, 30, 31, 32]
    with LlamaModel(path, n_ctx=256, device_top_k=0, n_threads=1, rewind=6, n_seq=n_seq) as m:
        if n_seq > 1:
            m.decode([11, 4, 8, 30, 2, 1, 2, 3, 4, 5, 6], 0, seq=2)  # cell 0
        m.decode(first, 0, seq=0)  # cell 1
        items = [(0, [54, 55, 56, 57], 11, True)]
        if n_seq > 1:
            m.decode([6, 6, 13, 27, 1, 9, 9, 8, 7, 6, 5], 0, seq=3)  # cell 2
            items += [(2, [61], 11, True), (3, [70], 11, True)]
        plain_calls = ubatch.plain_calls
        try:
            if grouped:  # (what llama.cpp does with a batch of several sequences of equal runs)
                ubatch.plain_calls = lambda *a, **k: plain_calls(*a[:4])  # (no cells: every group shares)
            m.decode_many(items)
        finally:
            ubatch.plain_calls = plain_calls
        if grouped:  # (llama.cpp's own rollback, which says yes: `RecurrentState` would go to a checkpoint instead,
            assert llama_cpp.llama_memory_seq_rm(m.memory, 0, 14, -1)  # as its cell map saw sequence 0 moved)
            assert m._recurrent is not None and m._recurrent._last_run[0] == 0
        else:
            assert m.truncate(14, 0) == 14
        return m.decode([58, 59], 14, all_logits=True, seq=0).logits.copy()


def test_a_rollback_after_other_sequences_decoded_is_what_the_sequence_alone_gives(hybrid_pair) -> None:
    """Several slots of a hybrid target: a verify rolled back after other slots' rows were decoded gives the rows
    the slot alone would (one sequence a call: `ubatch.whole_plan`)."""
    assert np.array_equal(_rolled_back_row(hybrid_pair[0], 4), _rolled_back_row(hybrid_pair[0], 1))


def test_canary_llamacpp_loses_a_moved_cells_snapshots(hybrid_pair) -> None:
    """Canary (docs/upstream.md): a ubatch of sequences 2 and 3 makes llama.cpp gather their states into
    neighbouring cells, swapping sequence 0's cell out of the way without its per-token snapshots, so sequence 0's
    rollback then reads another cell's snapshot. When this fails, llama.cpp moves snapshots with their cells:
    `whole_plan` may group sequences with snapshots again."""
    assert not np.array_equal(_rolled_back_row(hybrid_pair[0], 4, grouped=True), _rolled_back_row(hybrid_pair[0], 1))
