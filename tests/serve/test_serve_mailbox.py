"""Worker threads' events reach the event loop in order, one wake-up per burst."""

import asyncio
import threading

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
            loop.run_until_complete(asyncio.sleep(0))
            for parity, queue in enumerate(queues):
                assert [queue.get_nowait() for _ in range(50)] == [i for i in posts if i % 2 == parity]
                assert queue.empty()
            assert len(wake_ups) == burst + 1  # the loop was busy: one delivery took the whole burst
        assert mailbox(loop) is mailbox(loop) and mailbox(loop) is not box
    finally:
        loop.close()
