"""The scheduler on its own: plain Python, no MLX, no model.

The scheduler modules import no MLX (a fresh process runs one without it).  The
other tests drive the real ``PagedEngine.step`` over a pure stand-in for the model
runner (``FakeRunner``: a row's next token is a function of its context, and decode
tokens stay "in flight" for one step, as in the pipelined runner): admission,
prefill chunking, decode slots, preemption and sessions, with no model.
"""

import ast
import subprocess
import sys

from mlxq.worker.engine import PagedEngine
from mlxq.worker.engine.block_manager import BlockManager
from mlxq.worker.engine.hot_sessions import HotSession
from mlxq.shared.engine_config import EngineConfig
from mlxq.worker.engine.scheduler import PrefillPlan, Scheduler
from mlxq.worker.engine.sequence import Sampled
from mlxq.worker.engine.api import Engine, SeqSpec
from workerkit import neutral_cwd

from repokit import ROOT
BS = 4


def test_scheduler_runs_without_mlx():
    """Admission, a prefill plan and its postprocessing in a process that never imports MLX."""
    script = (
        "import sys\n"
        "from mlxq.worker.engine.api import SeqSpec\n"
        "from mlxq.worker.engine.block_manager import BlockManager\n"
        "from mlxq.shared.engine_config import EngineConfig\n"
        "from mlxq.worker.engine.scheduler import Scheduler\n"
        "from mlxq.worker.engine.sequence import Sampled\n"
        "s = Scheduler(BlockManager(8, 4, 'm'), EngineConfig())\n"
        "s.add([SeqSpec('a', [1, 2, 3, 4, 5], 1, stop_token_ids=())])\n"
        "plan = s.schedule_prefill()\n"
        "s.postprocess_prefill(plan, [Sampled(seq, 9) for seq in plan.ending_seqs()])\n"
        "events, _ = s.take_output()\n"
        "assert [(e.uid, e.token, e.finish_reason) for e in events] == [('a', 9, 'length')], events\n"
        "assert not s.has_work() and s.bm.num_used == 0\n"
        "loaded = sorted(m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm')))\n"
        "assert not loaded, loaded\n"
        "print('no mlx')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=neutral_cwd())
    assert out.returncode == 0, out.stderr
    assert "no mlx" in out.stdout


def _next_token(context: list[int]) -> int:
    return (sum(context) * 7 + len(context)) % 50 + 1


class FakeRunner:
    """The model runner's contract without tensors: decode results are read one step late."""

    def __init__(self):
        self.inflight: list = []
        self.prefill_plans: list[PrefillPlan] = []
        self.decode_batches: list[list[str]] = []

    def prefill(self, plan: PrefillPlan) -> list[Sampled]:
        self.prefill_plans.append(plan)
        return [Sampled(seq, _next_token(seq.tokens)) for seq in plan.ending_seqs()]

    def decode(self, rows) -> list[Sampled]:
        prev = self.inflight
        # a pending row's context includes the token still in flight
        pending = {id(s.seq): [s.token] for s in prev}
        self.inflight = [Sampled(s, _next_token(s.tokens + pending.get(id(s), []))) for s in rows]
        self.decode_batches.append([s.uid for s in rows])
        return prev

    def take_inflight(self) -> list[Sampled]:
        prev, self.inflight = self.inflight, []
        return prev

    def sample_deferred(self, alive) -> list:
        return []  # no grammar or penalties here: every launch is sampled at once


class Harness(PagedEngine):
    """The real engine (its step(), its settle hook) over a FakeRunner instead of a model."""

    def __init__(self, num_blocks=16, session_files=None, **config):  # no super().__init__: it loads a model
        self.bm = BlockManager(num_blocks, BS, "m")
        self.runner = FakeRunner()
        self.scheduler = Scheduler(self.bm, EngineConfig(**config), settle=self._settle,
                                   session_files=session_files)

    def run(self, max_steps=1000):
        tokens, finished, preempted = {}, {}, []
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                break
            events, pre = self.step()
            for e in events:
                assert e.uid not in finished, "token after finish"
                tokens.setdefault(e.uid, []).append(e.token)
                if e.finish_reason:
                    finished[e.uid] = e.finish_reason
            preempted += pre
        assert not self.scheduler.has_work()
        self.bm.check_invariants()
        return tokens, finished, preempted

    def run_resuming(self, specs, max_steps=400):
        """Add ``specs`` and step; each preempted sequence comes back as the worker resumes it (all it
        generated becomes context, the rest of max_tokens is still to come), its record holding every
        token it emitted. (tokens per uid, the preempted records)."""
        from dataclasses import replace

        specs = {s.uid: s for s in specs}
        self.scheduler.add(list(specs.values()))
        tokens, preempted = {}, []
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                break
            events, pre = self.step()
            for e in events:
                tokens.setdefault(e.uid, []).append(e.token)
            for p in pre:
                preempted.append(p)
                assert p.tokens == tokens.get(p.uid, [])
                s = specs[p.uid]
                self.scheduler.add([replace(s, resume_tokens=list(p.tokens), max_tokens=s.max_tokens - len(p.tokens))])
        return tokens, preempted


def _solo(prompt, n):
    h = Harness(num_blocks=64)
    h.scheduler.add([SeqSpec("x", prompt, n, stop_token_ids=())])
    return h.run()[0]["x"]


def test_batched_tokens_equal_solo_and_every_block_comes_back():
    prompts = [[i + 1] * (3 + 5 * i) for i in range(5)]
    h = Harness(num_blocks=64)
    h.scheduler.add([SeqSpec(f"s{i}", p, 6, stop_token_ids=()) for i, p in enumerate(prompts)])
    tokens, finished, _ = h.run()
    for i, p in enumerate(prompts):
        assert tokens[f"s{i}"] == _solo(p, 6)
        assert finished[f"s{i}"] == "length"
    assert h.bm.num_used == 0


def test_prefill_chunks_follow_the_schedule_and_the_budget():
    h = Harness(num_blocks=64, chunk_schedule=((8, 4), (None, 2)), step_token_budget=6)
    h.scheduler.add([SeqSpec("a", list(range(1, 15)), 2, stop_token_ids=()),
                 SeqSpec("b", list(range(1, 4)), 2, stop_token_ids=())])
    h.run()
    sizes = [[(seq.uid, n) for seq, n in plan.rows] for plan in h.runner.prefill_plans]
    # a: 4-token chunks below position 8, then 2-token ones; b joins a pass once both fit the budget
    assert sizes[:3] == [[("a", 4)], [("a", 4)], [("a", 2), ("b", 3)]]
    a_chunks = [n for plan in sizes for uid, n in plan if uid == "a"]
    assert a_chunks == [4, 4, 2, 2, 2]
    for plan in h.runner.prefill_plans:
        width = max(n for _, n in plan.rows)
        assert width * len(plan.rows) <= 6


def test_admission_waits_under_pressure_and_resumes_when_blocks_free():
    h = Harness(num_blocks=12, pressure=0.85)
    specs = [SeqSpec(f"a{i}", [i + 1] * 10, 3, stop_token_ids=()) for i in range(4)]
    h.scheduler.add(specs)
    h.step()
    st = h.stats()
    # 3 blocks each (10 tokens + the decode reserve): the 4th would pass 85% of 12
    assert st["running"] == 3 and st["waiting"] == 1
    tokens, finished, _ = h.run()
    assert set(finished) == {s.uid for s in specs}


def test_an_urgent_job_preempts_the_newest_least_urgent_one_with_every_token_it_generated():
    h = Harness(num_blocks=64, max_batch=3)
    low = [SeqSpec(f"low{i}", [i + 1] * 6, 20, priority=5.0, stop_token_ids=()) for i in range(3)]
    h.scheduler.add(low)
    emitted = {}
    for _ in range(4):
        for e in h.step()[0]:
            emitted.setdefault(e.uid, []).append(e.token)
    assert h.urgent_below() == 4.0
    h.scheduler.add([SeqSpec("urgent", [9] * 6, 3, priority=0.0, stop_token_ids=())])
    events, preempted = h.step()
    for e in events:
        emitted.setdefault(e.uid, []).append(e.token)
    assert [p.uid for p in preempted] == ["low2"]  # the newest of the least urgent
    # settled first: the preempted record has the token that was still in flight
    assert preempted[0].tokens == emitted["low2"]
    assert "urgent" in h.scheduler.running and "low2" not in h.scheduler.running


def test_a_small_priority_difference_does_not_preempt():
    h = Harness(num_blocks=64, max_batch=1, priority_gap=1.0)
    h.scheduler.add([SeqSpec("a", [1] * 5, 10, priority=1.0, stop_token_ids=())])
    h.step()
    h.scheduler.add([SeqSpec("b", [2] * 5, 10, priority=0.5, stop_token_ids=())])
    _, preempted = h.step()
    assert preempted == [] and h.stats()["waiting"] == 1


def test_with_no_priority_gap_equals_never_preempt_each_other():
    """priority_gap 0 (allowed: a job only a little more urgent preempts) lets a job preempt one of
    the same priority only if it ranks first (it arrived earlier): before, two of one priority (the
    n samples of a job share its score) preempted each other at every step, and neither finished.
    A pool that holds one of them at a time; each goes back to the waiting list when preempted, as
    the worker re-adds it."""
    h = Harness(num_blocks=6, priority_gap=0.0, max_batch=2, pressure=1.0, decode_reserve_blocks=0,
                chunk_schedule=((None, 4),), step_token_budget=4)
    specs = {u: SeqSpec(u, [i + 1] * 13, 4, priority=7.0, stop_token_ids=()) for i, u in enumerate(("a", "b"))}
    tokens, preempted = h.run_resuming(list(specs.values()))
    assert not h.scheduler.has_work(), f"still working after 400 steps, {len(preempted)} preemptions"
    assert {u: len(t) for u, t in tokens.items()} == {"a": 4, "b": 4} and tokens["a"] == _solo(specs["a"].prompt, 4)
    h.bm.check_invariants()
    assert h.bm.num_used == 0


def test_a_context_larger_than_the_pool_ends_at_once_and_blocks_nobody():
    """A sequence whose context alone cannot fit the pool ends with "error" when added (the worker
    refuses such a job through can_admit; the engine's own callers did not): waiting, it was never
    admitted and the sequences behind it waited for ever."""
    h = Harness(num_blocks=6, decode_reserve_blocks=1)
    assert not h.can_admit(25, 1)
    h.scheduler.add([SeqSpec("big", [1] * 25, 2, stop_token_ids=()), SeqSpec("small", [2] * 3, 2, stop_token_ids=())])
    events, _ = h.step()
    big = [e for e in events if e.uid == "big"]
    assert len(big) == 1 and big[0].finish_reason == "error" and "do not fit" in big[0].error
    first = [e.token for e in events if e.uid == "small"]
    tokens, finished, _ = h.run()
    assert finished == {"small": "length"} and first + tokens["small"] == _solo([2] * 3, 2)


def test_a_full_pool_mid_decode_preempts_and_the_victim_resumes_exactly():
    prompt_a, prompt_b = [1] * 7, [2] * 7
    h = Harness(num_blocks=6, pressure=1.0, decode_reserve_blocks=0)
    tokens, preempted = h.run_resuming([SeqSpec("a", prompt_a, 12, stop_token_ids=()),
                                        SeqSpec("b", prompt_b, 12, stop_token_ids=(), priority=1.0)], max_steps=200)
    assert preempted and {p.uid for p in preempted} == {"b"}
    assert tokens["a"] == _solo(prompt_a, 12)
    assert tokens["b"] == _solo(prompt_b, 12)
    h.bm.check_invariants()
    assert h.bm.num_used == 0


def test_prefix_hits_skip_computed_blocks():
    h = Harness(num_blocks=64)
    shared = list(range(1, 13))  # three full blocks
    h.scheduler.add([SeqSpec("a", shared + [20], 2, stop_token_ids=())])
    h.run()
    h.scheduler.add([SeqSpec("b", shared + [30, 31], 2, stop_token_ids=())])
    plan = h.scheduler.schedule_prefill()
    assert [(seq.uid, seq.num_computed, n) for seq, n in plan.rows] == [("b", 12, 2)]
    assert h.stats()["prefix_hit_tokens"] == 12


class FakeSessionFiles:
    def __init__(self):
        self.files: dict = {}

    def spill(self, session_id, block_ids, tokens):
        self.files[session_id] = list(tokens)

    def load(self, session_id):
        tokens = self.files.get(session_id)
        return None if tokens is None else type("Warm", (), {"tokens": tokens})()

    def restore(self, warm, block_ids, lo, hi):
        assert len(block_ids) * BS == hi - lo


def test_sessions_stay_hot_spill_under_pressure_and_come_back_from_disk():
    files = FakeSessionFiles()
    h = Harness(num_blocks=10, session_files=files, pressure=1.0)
    turn1 = list(range(1, 11))
    h.scheduler.add([SeqSpec("t1", turn1, 3, session_id="chat", stop_token_ids=())])
    out1 = h.run()[0]["t1"]
    hot = h.scheduler.hot_sessions.by_id["chat"]
    assert isinstance(hot, HotSession) and h.bm.num_used == len(hot.block_ids) == 3
    # a big job needs the pinned blocks: the session is spilled, not the job refused
    h.scheduler.add([SeqSpec("big", [40] * 30, 2, stop_token_ids=())])
    h.run()
    assert "chat" not in h.scheduler.hot_sessions.by_id and files.files["chat"] == hot.tokens
    assert h.stats()["session_spills"] == 1
    # the next turn restores what the prefix cache lost
    turn2 = turn1 + out1 + [5, 6, 7]
    h.scheduler.add([SeqSpec("t2", turn2, 2, session_id="chat", stop_token_ids=())])
    plan = h.scheduler.schedule_prefill()
    assert h.stats()["session_restores"] == 1
    assert plan.rows[0][0].num_computed == 12


def test_without_the_prefix_cache_sessions_pin_nothing():
    """With the prefix cache off, no turn can use a session's blocks (the lookup is off): a finished
    turn pins none and writes no file. Before, it pinned its blocks (pressure, spills) for nothing."""
    files = FakeSessionFiles()
    h = Harness(num_blocks=10, session_files=files, pressure=1.0, prefix_cache=False)
    turn1 = list(range(1, 11))
    h.scheduler.add([SeqSpec("t1", turn1, 3, session_id="chat", stop_token_ids=())])
    out1 = h.run()[0]["t1"]
    assert not h.scheduler.hot_sessions.by_id and h.bm.num_used == 0
    h.scheduler.add([SeqSpec("big", [40] * 30, 2, stop_token_ids=())])
    h.scheduler.add([SeqSpec("t2", turn1 + out1 + [5], 2, session_id="chat", stop_token_ids=())])
    h.run()
    st = h.stats()
    assert st["session_spills"] == 0 and st["session_restores"] == 0 and not files.files and h.bm.num_used == 0


def test_removed_and_finished_rows_waste_their_in_flight_token_only():
    h = Harness(num_blocks=64)
    h.scheduler.add([SeqSpec("a", [1] * 5, 50, stop_token_ids=()),
                     SeqSpec("b", [2] * 5, 50, stop_token_ids=())])
    for _ in range(3):
        h.step()
    h.scheduler.remove(["a"])
    events, _ = h.step()
    assert {e.uid for e in events} == {"b"}
    h.scheduler.remove(["b"])
    assert not h.scheduler.has_work() and h.bm.num_used == 0


def test_the_engine_protocol_lists_what_the_runner_calls():
    """The worker's rooms call nothing on their engine that the Engine protocol does not declare."""
    rooms = ("runner.py", "mlx_loop.py", "host.py", "fetcher.py")
    called = {node.attr for room in rooms for node in ast.walk(ast.parse((ROOT / "worker" / room).read_text()))
              if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
              and node.value.attr == "engine" and isinstance(node.value.value, ast.Name)
              and node.value.value.id == "self"}
    declared = {n for n in vars(Engine) if not n.startswith("_")}
    assert called and called <= declared, called - declared


def test_paged_engine_implements_the_protocol():
    declared = {n for n in vars(Engine) if not n.startswith("_")}
    assert all(callable(getattr(PagedEngine, n, None)) for n in declared)
