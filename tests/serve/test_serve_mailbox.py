"""Worker threads' events reach the event loop in order, one wake-up per burst."""

import asyncio
import json
import threading

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


def test_a_plain_answer_wakes_the_loop_at_its_end_and_a_stream_at_each_piece(runs_dir, monkeypatch):
    """A plain answer is read only whole: waking the loop for each of its tokens (a thread switch each) set a small
    model's pace under 8 clients. A stream's pieces still go out as they are made."""
    testclient = pytest.importorskip("starlette.testclient")
    from gptforge.serve.app import build_app

    deliveries = []
    deliver = Mailbox._deliver
    monkeypatch.setattr(Mailbox, "_deliver", lambda box: (deliveries.append(len(box.pending)), deliver(box)))
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
