"""The paged-KV generation engine (implements ``mlxq.worker.engine.api.Engine``).

One ``step()`` reads like nano-vllm's: schedule, run, postprocess, twice (a
prefill pass, then a decode launch)::

    plan = scheduler.schedule_prefill()        # admission, preemption, prompt chunks
    scheduler.postprocess_prefill(plan, runner.prefill(plan))
    rows = scheduler.schedule_decode(...)      # a slot for each decoding row's token
    scheduler.postprocess_decode(rows, runner.decode(rows))  # launch n+1, read n
    runner.sample_deferred(...)                # rows with a grammar or penalties: sample n+1 now

A row whose logits depend on its previous token as the host sees it (a grammar mask, a
penalty: ``logit_shaping.py``) makes the launch run its forward pass only; once token n is
read and the scheduler has fed it to the row's matcher, the masks are computed (llguidance's
threads, GIL released) while that forward pass runs, and the batch is sampled with them.
A batch without such rows keeps the one-graph launch.

With speculative decoding on (``speculative.py``), a step the speculator picks reads the launch in
flight, lets the picked rows propose, and runs every decode row in one verify pass instead
(``ModelRunner.verify``, read at once): a row emits its accepted proposal tokens and one more.

``scheduler.py`` decides (plain Python, no MLX); ``model_runner.py`` turns its
plans into arrays and runs them (every ``mx.eval``); ``block_manager.py`` keeps
the block bookkeeping; all KV lives in ``kv_cache.KVPool`` and the stock mlx-lm
model runs over ``PagedLayerCache`` objects.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Optional, Sequence

from ...shared.engine_config import DEFAULT_KV_MEMORY_MB, SPECULATE_MODES, EngineConfig
from ...shared.settings import Settings

from .api import Preempted, SeqSpec, TokenEvent
from . import hugepages, intake
from .attention import batch_dependence, use_attention
from .block_manager import BlockManager
from .logit_shaping import GrammarBook, GrammarError, RowGrammar
from .decode_forward import DecodeForward
from .kv_cache import KVPool, make_kv_quant, probe_kv_shape
from .model_runner import ModelRunner
from .rows import proposal_slots
from .scheduler import Scheduler
from .sessions import SessionFiles
from .speculative import Speculator

log = logging.getLogger(__name__)


def make_engine(loaded, settings: Optional[Settings] = None) -> "PagedEngine":
    """The worker's engine for a loaded model (``mlxq.worker.model.LoadedModel``): paged continuous
    batching (prefix cache, admission, preemption, sessions), configured by ``settings``
    (default: ``Settings.from_env()``)."""
    settings = settings or Settings.from_env()
    config = settings.engine_config()
    draft = load_draft(config.draft_model, loaded) if config.speculate == "draft" else None
    return PagedEngine(loaded.model, config, eos_token_ids=loaded.eos_token_ids, model_id=loaded.name,
                       context_length=loaded.context_length, tokenizer=loaded.tokenizer, draft=draft)


def load_draft(source: str, loaded):
    """The draft model at ``source`` (loaded as the worker loads its model), refused unless its
    tokenizer is ``loaded``'s: proposals are token ids of the model's vocabulary."""
    from ..model import load_model

    draft = load_model(source, name="draft")
    vocab = getattr(loaded.tokenizer, "get_vocab", None)
    if vocab is None or draft.tokenizer.get_vocab() != vocab():
        raise ValueError(f"--draft-model {source}: its tokenizer is not the model's (a draft proposes the model's "
                         "token ids: it needs the same vocabulary)")
    return draft.model


class PagedEngine:
    """Builds the pool, the runner and the scheduler for one model; ``step()`` drives them."""

    speculator: Optional[Speculator] = None  # speculative decoding's policy (None: off)
    drafter = None  # a draft model's proposer (draft.Drafter; None: prompt lookup)
    _last_plain = False  # the step before was a plain decode step alone (its time measured)
    _verify_started = 0.0  # this step's verify pass began (after its settle)

    def __init__(
        self,
        model,
        config: Optional[EngineConfig] = None,
        *,
        eos_token_ids: Sequence[int] = (),
        model_id: str = "",
        context_length: Optional[int] = None,
        tokenizer=None,
        draft=None,
        **options,
    ):
        """``config`` (default: ``EngineConfig()``) with ``options``, fields of it set by name, over it
        (tests and benchmarks set a few); the rest comes from the model.  ``draft``: the draft model
        of speculate "draft" (an mlx-lm model with the model's vocabulary)."""
        config = replace(config or EngineConfig(), **options)
        if config.speculate not in SPECULATE_MODES:
            raise ValueError(f"speculate={config.speculate!r}: must be one of {', '.join(SPECULATE_MODES)}")
        if config.speculate_k < 1:
            raise ValueError(f"speculate_k={config.speculate_k!r}: must be at least 1")
        if (config.speculate == "draft") != (draft is not None):
            raise ValueError("speculate='draft' needs a draft model, and a draft model speculate='draft'")
        self.config = config
        self.model = model
        self.tokenizer = tokenizer  # mlx-lm's TokenizerWrapper: constrained output needs it
        self.eos_token_ids = tuple(eos_token_ids)
        self._book_error: Optional[str] = None  # why constrained output is unavailable, once known
        block_size = self.block_size = config.block_size
        self.kv_shape = probe_kv_shape(model)
        quant = make_kv_quant(config.kv_bits, config.kv_group_size)
        if quant is not None:
            quant.check(self.kv_shape.head_dims())  # before anything is allocated
        per_block = self.kv_shape.bytes_per_block(block_size, quant=quant)
        num_blocks = config.num_blocks
        if num_blocks is None:
            budget = config.memory_budget_bytes or DEFAULT_KV_MEMORY_MB * 2**20
            num_blocks = budget // per_block
            if config.memory_budget_bytes is None and context_length:
                # the default budget never exceeds what max_sequences full contexts need
                num_blocks = min(num_blocks,
                                 (config.max_batch or config.max_sequences) * -(-context_length // block_size))
        if num_blocks < 2:
            raise ValueError(f"memory budget too small: {per_block} bytes per block")
        self.bm = BlockManager(num_blocks, block_size, model_id)
        self.pool = KVPool(self.kv_shape, num_blocks, block_size, dtype=self.kv_shape.dtype, quant=quant)
        self.runner = ModelRunner(model, self.pool)
        # auto / fused / gather; logs its choice
        self.attention = use_attention(model, self.pool, config.attention, matmul=config.matmul)
        if config.huge_pages:  # the weights a step streams through and the pool (see hugepages.py)
            # before the decode forward, which keeps each packed layer's scales and biases: it must keep
            # the packed buffers' views, not the arrays they replace
            hugepages.advise(hugepages.pack(model) + self.pool.arrays())
        self.runner.decode_forward, why = DecodeForward.build(model, self.pool, self.attention)
        self.decode_path = f"{'decode_forward' if self.runner.decode_forward else 'the model file'} ({why})"
        log.info("decode steps: %s", self.decode_path)
        self.sessions = SessionFiles(config.session_dir, model_id, self.pool) if config.session_dir else None
        self.scheduler = Scheduler(self.bm, config, eos_token_ids=eos_token_ids, settle=self._settle,
                                   session_files=self.sessions, start_grammar=self._start_grammar)
        self.speculate = self._speculation(config.speculate)
        if self.speculate != "off":
            self.speculator = Speculator(config.speculate_k, self.runner.can_verify, self.runner.verify_pads)
        if draft is not None:
            from .draft import Drafter

            self.drafter = Drafter(draft, num_blocks, block_size)
            log.info("speculative decoding with a draft model: %.1f MiB draft KV pool",
                     self.drafter.pool.nbytes / 2**20)
        log.info("paged engine: %d blocks of %d tokens, %.1f MiB %s pool",
                 num_blocks, block_size, self.pool.nbytes / 2**20, self.pool.layout)

    def _speculation(self, mode: str) -> str:
        """The speculation this engine runs: ``mode``, where "auto" is prompt lookup only where a verify
        pass's positions are bit for bit one-token steps' (else its output could part from the plain
        engine's at a near-tie, which auto must never cause), off elsewhere."""
        if mode != "auto":
            return mode
        why = batch_dependence(self.attention, self.model)
        log.info("speculative decoding: %s", "prompt lookup (auto)" if why is None else f"off (auto: {why})")
        return "ngram" if why is None else "off"

    def step(self) -> tuple[list[TokenEvent], list[Preempted]]:
        """Schedule, run, postprocess: a prefill pass, then a decode launch (read one step later),
        or a verify pass (speculative decoding: read at once)."""
        sched = self.scheduler
        start = time.perf_counter()
        plan = sched.schedule_prefill()
        just_prefilled = []
        if plan is not None:
            sched.postprocess_prefill(plan, self.runner.prefill(plan))
            just_prefilled = plan.ending_seqs()
        rows = sched.schedule_decode(skip=just_prefilled)
        verified = None
        if self.speculator is not None and rows:
            rows, verified = self._verify(rows)
        if verified is None:
            sched.postprocess_decode(rows, self.runner.decode(rows))
            # rows with a grammar or penalties are sampled now, their previous token consumed
            for seq, why in self.runner.sample_deferred(sched.is_running):
                sched.fail(seq, why)
        if self.speculator is not None:
            self._measure(plan is None and bool(rows), verified, len(rows), start)
        return sched.take_output()

    def _measure(self, decode_only: bool, verified: Optional[int], rows: int, start: float) -> None:
        """Give the speculator this step's time, where it is a decode step's alone: a verify pass
        from after its settle (the launch it read was the step before's work), a plain step only
        after another plain step (one after a verify pass read nothing: it cost less than its own)."""
        after_plain, self._last_plain = self._last_plain, decode_only and verified is None
        if not decode_only:
            return
        if verified is not None:
            self.speculator.costs.record(True, verified, time.perf_counter() - self._verify_started)
        elif after_plain:
            self.speculator.costs.record(False, rows, time.perf_counter() - start)

    def _verify(self, rows: list) -> tuple[list, Optional[int]]:
        """Speculate, when the speculator picks rows this step: the decode in flight is read, the
        picked rows propose, and every decode row runs in one verify pass (the rows without a
        proposal feed their one token).  Returns the rows still running and the positions the pass
        computed, or None: no pass ran, the rows make a plain decode step."""
        sched = self.scheduler
        picked = self.speculator.pick(rows)
        if not picked:
            return rows, None
        self._settle()  # proposals continue the rows' last tokens: those in flight are read first
        self._verify_started = time.perf_counter()
        spec = self.speculator
        rows = [s for s in rows if sched.is_running(s)]
        ks = [spec.room(s, picked.get(id(s), 0)) for s in rows]
        if self.drafter is not None:  # the draft model writes its KV in the slots the pass verifies
            ks = proposal_slots(sched.bm, rows, ks, self.config.decode_reserve_blocks)
            drafts = [spec.allowed(s, d) for s, d in zip(rows, self.drafter.propose(rows, ks))]
        else:
            drafts = [spec.propose(s, k) for s, k in zip(rows, ks)]
            ks = proposal_slots(sched.bm, rows, [len(d) for d in drafts], self.config.decode_reserve_blocks)
            drafts = [spec.allowed(s, d[:k]) for s, d, k in zip(rows, drafts, ks)]
        if not any(drafts):
            for s in rows:
                sched.bm.shrink_table(s.block_table, s.num_computed + 1)  # the plain launch writes its one position
            return rows, None
        sched.postprocess_verify(rows, drafts, self.runner.verify(rows, drafts))
        padded = len(rows) * (1 + max(len(d) for d in drafts))  # ragged rows padded to the longest
        return rows, padded if self.runner.verify_pads() else sum(1 + len(d) for d in drafts)

    def _start_grammar(self, grammar: str, resume_tokens: list[int]) -> RowGrammar:
        """The scheduler's hook for a constrained sequence: its matcher, at its resume point (the
        model's llguidance tokenizer is built on the first one)."""
        if self.runner.book is None:
            if self._book_error is None:
                self._book_error = "this engine has no tokenizer" if self.tokenizer is None else ""
            if self._book_error:
                raise GrammarError(f"constrained output is unavailable: {self._book_error}")
            try:
                self.runner.book = GrammarBook(self.tokenizer, self.eos_token_ids)
            except Exception as exc:  # e.g. a slow (non-Rust) tokenizer llguidance cannot read
                self._book_error = f"llguidance cannot read this model's tokenizer ({exc})"
                log.warning("%s", self._book_error)
                raise GrammarError(f"constrained output is unavailable: {self._book_error}") from None
        return self.runner.book.start(grammar, resume_tokens)

    def _settle(self) -> None:
        """Read the decode still in flight now (the scheduler's hook: before a preemption, or when
        the pool runs short mid-decode and finished rows must give their blocks back first)."""
        self.scheduler.collect(self.runner.take_inflight())

    # ================================================================ the rest of the Engine API
    def add(self, specs: list[SeqSpec]) -> None:
        if not self.runner.split_head and any(s.embed is not None for s in specs):
            why = (f"this model's architecture ({type(self.model).__module__}) gives the engine no hidden "
                   "states to pool: embeddings need a llama, qwen2 or qwen3 model")
            for spec in specs:
                if spec.embed is not None:
                    self.scheduler.refuse(spec.uid, why)
            specs = [s for s in specs if s.embed is None]
        self.scheduler.add(specs)

    def remove(self, uids: list[str]) -> None:
        self.scheduler.remove(uids)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def free_slots(self) -> int:
        return intake.free_slots(self.scheduler)

    def urgent_below(self) -> float:
        return intake.urgent_below(self.scheduler)

    def can_admit(self, prompt_len: int, max_tokens: int) -> bool:
        return intake.can_admit(self.scheduler, prompt_len, max_tokens)

    def stats(self) -> dict:
        sched, c, k = self.scheduler, self.bm.counts(), self.scheduler.counters
        return {
            "blocks_total": c.total, "blocks_used": c.used, "blocks_cached": c.cached, "blocks_free": c.free,
            "prefix_hit_tokens": k.prefix_hit_tokens, "fork_shared_tokens": k.fork_shared_tokens,
            "prompt_tokens": k.prompt_tokens, "preemptions": k.preemptions, "evictions": self.bm.evictions,
            "running": len(sched.running), "waiting": len(sched.waiting), "sessions_hot": len(sched.hot_sessions),
            "session_spills": k.session_spills, "session_restores": k.session_restores,
            "engine_steps": k.steps, "prefill_passes": k.prefill_passes, "decode_passes": k.decode_passes,
            "verify_passes": k.verify_passes, "draft_proposed": k.draft_proposed, "draft_accepted": k.draft_accepted,
        }

    @property
    def counters(self):
        return self.scheduler.counters

    def close(self) -> None:
        """Spill every hot session (to disk when a session dir is set)."""
        self._settle()
        self.scheduler.hot_sessions.spill_all()
