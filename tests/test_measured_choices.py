"""Start-up measurements kept per machine: the first process measures while holding the file's lock, every other
process (started at the same time, or later) reads the same result, so a server's ranks and a prefill and a
decode server compute alike; a damaged file is measured again; an unwritable place measures in the process."""

import json
import multiprocessing
import os
import time

from moeplex.kernels.cpu import MeasuredChoices


def choose(path: str, queue) -> None:
    def measure():
        time.sleep(0.3)  # long enough for the other process to be waiting on the lock
        return {"pid": os.getpid()}

    queue.put(MeasuredChoices(path).get("kind", "key", measure)["pid"])


def test_processes_started_together_measure_once_and_agree(tmp_path):
    path = str(tmp_path / "choices.json")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=choose, args=(path, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert len(set(results)) == 1 and results[0] in {p.pid for p in procs}
    later = MeasuredChoices(path).get("kind", "key", lambda: {"pid": -1})
    assert later["pid"] == results[0]


def test_keys_are_apart_and_a_damaged_file_is_measured_again(tmp_path):
    path = tmp_path / "choices.json"
    store = MeasuredChoices(str(path))
    assert store.get("a", "1", lambda: [1]) == [1] and store.get("a", "2", lambda: [2]) == [2]
    assert store.get("b", "1", lambda: "x") == "x"
    assert len(json.loads(path.read_text())) == 3
    path.write_text("{not json")
    assert MeasuredChoices(str(path)).get("a", "1", lambda: [9]) == [9]


def test_an_unwritable_place_measures_in_the_process(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = MeasuredChoices(str(blocker / "sub" / "choices.json"))  # a folder under a file cannot be made
    calls = []
    assert store.get("a", "1", lambda: calls.append(1) or 5) == 5 and store.get("a", "1", lambda: 6) == 5
    assert calls == [1]
