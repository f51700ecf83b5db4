"""Worker threads' events reach the event loop in order, one wake-up per burst."""

import asyncio
import json
import threading
import time

import pytest

from gptforge.serve.mailbox import Mailbox, mailbox


def test_events_posted_from_threads_arrive_in_order_with_one_wake_up_per_burst():
    loop = asyncio.new_event_loop()
    try:
        box, queues, wake_ups = Mailbox(loop), (asyncio.Queue(), asyncio.Queue()), []
        schedule = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda callback, *args: (wake_ups.append(callback), schedule(callback, *args))
        for burst in range(2):
            posts = range(burst * 100, burst * 100 + 100)
            worker = threading.Thread(target=lambda posts=posts: [box.post(queues[i % 2], i) for i in posts])
            worker.start()
            worker.join()
            loop.run_until_complete(asyncio.sleep(3 * box.tick))  # delivered, and a quiet tick after it
            for parity, queue in enumerate(queues):
                assert [queue.get_nowait() for _ in range(50)] == [i for i in posts if i % 2 == parity]
                assert queue.empty()
            assert len(wake_ups) == burst + 1  # the loop was busy: one delivery took the whole burst
        assert mailbox(loop) is mailbox(loop) and mailbox(loop) is not box
    finally:
        loop.close()


def test_events_posted_within_a_tick_of_a_delivery_wait_for_it_and_a_quiet_tick_lets_the_next_wake_the_loop():
    loop = asyncio.new_event_loop()
    try:
        box, queue, wake_ups = Mailbox(loop, tick=0.05), asyncio.Queue(), []
        schedule = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda callback, *args: (wake_ups.append(callback), schedule(callback, *args))
        box.post(queue, "first")
        loop.run_until_complete(asyncio.sleep(0))
        assert queue.get_nowait() == "first" and len(wake_ups) == 1  # a quiet mailbox delivers at once
        box.post(queue, "second", "third")
        loop.run_until_complete(asyncio.sleep(0.01))
        assert queue.empty() and len(wake_ups) == 1  # held for the tick, with no wake-up of its own
        loop.run_until_complete(asyncio.sleep(0.06))
        assert [queue.get_nowait(), queue.get_nowait()] == ["second", "third"] and len(wake_ups) == 1
        loop.run_until_complete(asyncio.sleep(0.06))  # a tick with nothing: the timer stops
        box.post(queue, "fourth")
        loop.run_until_complete(asyncio.sleep(0))
        assert queue.get_nowait() == "fourth" and len(wake_ups) == 2
    finally:
        loop.close()


def test_an_urgent_event_goes_at_once_with_those_held_before_it_and_the_tick_keeps_its_time():
    loop = asyncio.new_event_loop()
    try:
        box, queue = Mailbox(loop, tick=0.05), asyncio.Queue()
        box.post(queue, "first")
        loop.run_until_complete(asyncio.sleep(0))
        first_tick = box.timer
        box.post(queue, "held")
        box.post(queue, "end", urgent=True)
        loop.run_until_complete(asyncio.sleep(0))
        assert [queue.get_nowait() for _ in range(3)] == ["first", "held", "end"]
        assert box.timer is first_tick and not first_tick.cancelled()  # the tick keeps its time: one at a time
    finally:
        loop.close()


def test_a_stream_s_first_text_and_a_request_s_end_do_not_wait_for_the_tick(runs_dir, monkeypatch):
    """A slow tick shows it: the first piece (the time to first token) and the end come at once."""
    testclient = pytest.importorskip("starlette.testclient")
    import gptforge.serve.mailbox
    from gptforge.serve.app import build_app

    monkeypatch.setattr(gptforge.serve.mailbox, "TICK", 30.0)
    client = testclient.TestClient(build_app(runs_dir))
    body = {"model": "alpha", "prompt": "def f", "max_tokens": 8, "temperature": 0}
    start = time.monotonic()
    assert client.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 8
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]" and time.monotonic() - start < 20
    assert len([t for t in texts if t]) == 2  # the first piece alone, then the rest with the end


def test_a_plain_answer_wakes_the_loop_at_its_end_and_a_stream_at_each_piece(runs_dir, monkeypatch):
    """A plain answer is read only whole: waking the loop for each of its tokens (a thread switch each) set a small
    model's pace under 8 clients. A stream's pieces still go out as they are made."""
    testclient = pytest.importorskip("starlette.testclient")
    from gptforge.serve.app import build_app

    deliveries = []
    flush = Mailbox._flush

    def counted(box: Mailbox) -> None:
        if box.pending:  # a delivery, not an empty tick
            deliveries.append(len(box.pending))
        flush(box)

    monkeypatch.setattr(Mailbox, "_flush", counted)
    client = testclient.TestClient(build_app(runs_dir))
    body = {"model": "alpha", "prompt": "def f", "max_tokens": 16, "temperature": 1.0, "seed": 1, "n": 2}
    answer = client.post("/v1/completions", json=body).json()
    assert answer["usage"]["completion_tokens"] >= 16
    assert len(deliveries) == 1  # Started and the whole text, with its end
    deliveries.clear()
    streamed = ["", ""]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                streamed[choice["index"]] += choice["text"]
    assert len(deliveries) >= 8
    assert [c["text"] for c in answer["choices"]] == streamed and streamed[0] != streamed[1]


def test_a_burst_goes_out_as_one_piece_for_each_run_of_a_choices_text():
    from gptforge.serve.api import _merged
    from gptforge.serve.jobs import Done, Finish, Started, Text

    started, finish, done = Started("fp", "m"), Finish(0, "stop"), Done({})
    burst = [started, Text(0, "a"), Text(0, "b"), Text(1, "c"), Text(1, "d"), Text(0, "e"), finish, Text(0, "f"), done]
    assert _merged(burst) == [started, Text(0, "ab"), Text(1, "cd"), Text(0, "e"), finish, Text(0, "f"), done]
