"""Conversations built from documented functions: the request, the reply, and the measure of a reply."""

from gptforge.data.chat.instructions import defines_function, function_tasks

SOURCE = '''
import functools


def undocumented(x):
    return x


class Stack:
    @functools.cache
    def peek(self, default: int = 0) -> int:
        """The top item, or `default`.

        Long description that the request leaves out.
        """
        if self.items:
            return self.items[-1]
        return default


async def fetch(url, *, retries=3):
    """Fetch `url`."""
    for _ in range(retries):
        return url
'''


def test_each_documented_function_becomes_a_request_and_its_source():
    tasks = list(function_tasks([("pkg/stack.py", SOURCE), ("broken.py", "def (:")]))
    assert [(t.document, t.name) for t in tasks] == [("pkg/stack.py", "peek"), ("pkg/stack.py", "fetch")]
    peek = tasks[0].messages
    assert [m.role for m in peek] == ["user", "assistant"]
    request = "Write a Python function `peek(self, default: int=0) -> int`.\nThe top item, or `default`."
    assert peek[0].content == request
    assert peek[1].content.startswith('def peek(self, default: int = 0) -> int:\n    """The top item')
    # dedented out of the class, the decorator left out
    assert peek[1].content.endswith("\n        return self.items[-1]\n    return default")
    assert tasks[1].messages[0].content.startswith("Write a Python async function `fetch(url, *, retries=3)`.")


def test_a_reply_counts_when_it_parses_and_defines_the_function_asked_for():
    assert defines_function("def peek(self):\n    return 1\n", "peek")
    assert defines_function("class A:\n    async def peek(self):\n        pass\n", "peek")
    assert not defines_function("def peek(self):\nreturn 1\n", "peek")
    assert not defines_function("def top(self):\n    return 1\n", "peek")
    assert not defines_function("peek = lambda: 1\n", "peek")


def test_conversations_take_their_file_s_split():
    from gptforge.data.chat.instructions import conversation_rows
    from gptforge.data.pipeline import is_validation

    documents = [(f"pkg/m{i}.py", SOURCE) for i in range(40)]
    rows = list(conversation_rows(documents, val_fraction=0.2, seed=3))
    assert len(rows) == 80 and {r["source"].split(":")[1] for r in rows} == {"peek", "fetch"}
    for row in rows:
        name = row["source"].split(":")[0]
        index = int(name[5:-3])
        assert row["split"] == ("val" if is_validation(name, index, 0.2, 3) else "train")
    assert 0 < sum(r["split"] == "val" for r in rows) < 80
