"""The CPU thread governor (engine/cpu/threads.py): fewer threads while steps are starved of cores, back up after a
probe that was not starved; driven by a fake clock (no timing in the test)."""

from flowrt.engine.cpu.threads import ThreadGovernor


class Sim:
    """Feeds the governor steps of 0.1 s wall; `cores` is how many cores the process gets (CPU = min(threads,
    cores) x wall)."""

    def __init__(self, max_threads=2, **kw):
        self.calls: list[int] = []
        self.gov = ThreadGovernor(max_threads, set_threads=self.calls.append, **kw)
        self.now = 0.0

    def run(self, seconds: float, cores: float) -> None:
        for _ in range(round(seconds / 0.1)):
            self.now += 0.1
            self.gov.observe(0.1, 0.1 * min(self.gov.threads, cores), self.now)


def test_all_cores_available_keeps_every_thread():
    s = Sim(max_threads=4)
    s.run(30, cores=4)
    assert s.gov.threads == 4 and s.calls == []


def test_starved_steps_drop_threads_one_at_a_time():
    s = Sim(max_threads=4)
    s.run(0.5, cores=2.5)  # one starved window (2.5 cores for 4 threads: 62%): not enough to act
    assert s.gov.threads == 4
    s.run(0.5, cores=2.5)
    assert s.calls == [3]
    s.run(1.0, cores=2.5)  # 3 threads on 2.5 cores (83%) are not starved: no further drop
    assert s.gov.threads == 3 and s.calls == [3]
    s.run(1.0, cores=1.5)  # 3 threads on 1.5 cores: starved again
    assert s.calls[-1] == 2


def test_probe_keeps_the_thread_when_cores_came_back():
    s = Sim(max_threads=2)
    s.run(1.0, cores=1)
    assert s.gov.threads == 1
    s.run(1.0, cores=2)  # before the probe time: stays at 1
    assert s.gov.threads == 1
    s.run(2.0, cores=2)  # probe at +2 s, not starved: kept
    assert s.gov.threads == 2 and s.calls == [1, 2]
    s.run(10, cores=2)
    assert s.gov.threads == 2


def test_failed_probes_revert_and_back_off():
    s = Sim(max_threads=2, probe_s=2.0, max_probe_s=8.0)
    s.run(1.0, cores=1)
    assert s.calls == [1]
    s.run(30, cores=1)
    # probes at ~+2, then backoff 4, 8, 8, ... each reverted: [2, 1] pairs, never more than max_threads
    assert s.gov.threads == 1
    probes = s.calls[1:]
    assert probes and probes == [2, 1] * (len(probes) // 2)
    assert 3 <= len(probes) // 2 <= 5  # 2 + 4 + 8 + 8 + 8 s of backoff, not a probe every window
    assert max(s.calls) <= 2


def test_one_thread_is_the_floor():
    s = Sim(max_threads=2)
    s.run(20, cores=0.3)
    assert min(s.calls) == 1 and s.gov.threads == 1


def test_engine_governs_threads_unless_turned_off(stories_path):
    import torch

    from flowrt.engine import LLM, SamplingParams

    n = torch.get_num_threads()
    on = LLM(stories_path, dtype="float32")
    on.generate(["Once upon"], SamplingParams(max_tokens=4, temperature=0))
    st, gov = on.engine.stats(), on.engine.threads
    assert (gov is not None) == (n > 1)
    if gov is not None:  # the stats report the governor's thread count and how often it changed it
        assert 1 <= gov.threads <= n
        assert (st["cpu_threads"], st["cpu_thread_changes"]) == (gov.threads, gov.changes)
    else:
        assert (st["cpu_threads"], st["cpu_thread_changes"]) == (n, 0)
    off = LLM(stories_path, dtype="float32", adaptive_threads=False)
    assert off.engine.threads is None and off.engine.stats()["cpu_thread_changes"] == 0
    torch.set_num_threads(n)


def _native_threads() -> int:
    import os

    return len(os.listdir("/proc/self/task"))


def test_release_openmp_team_ends_the_calling_threads_workers():
    """A thread that ran a torch op keeps an OpenMP team (native worker threads) until it exits; released, its
    workers end, so the engine's team is again the process's only one (libgomp spins only while the process has no
    more OpenMP threads than cores)."""
    import threading

    import pytest
    import torch

    from flowrt.engine.cpu import threads as cpu_threads

    if cpu_threads._libgomp_pause() is None:
        pytest.skip("the OpenMP runtime here is not libgomp 9+")
    seen: dict[str, int | bool] = {}
    before_threads = torch.get_num_threads()

    def work():
        torch.set_num_threads(2)
        before = _native_threads()
        torch.nn.functional.gelu(torch.randn(4_000_000))  # a parallel region: this thread's team of 2
        seen["with_team"] = _native_threads() - before
        seen["released"] = cpu_threads.release_openmp_team()
        seen["after"] = _native_threads() - before

    try:
        t = threading.Thread(target=work)
        t.start()
        t.join()
    finally:
        torch.set_num_threads(before_threads)
    assert seen == {"with_team": 1, "released": True, "after": 0}
