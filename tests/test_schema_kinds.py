"""The request schema's kinds: lists of scalars are checked in one pass and still refuse what they refused."""

import pytest

from moeplex.server.errors import ApiError
from moeplex.server.openai_completions import PROMPT
from moeplex.server.schema import INTEGER, STRING, AnyOf, Field, ListOf, ObjectOf, parse, prune

IDS = ListOf(INTEGER, "an array of token ids", min_items=1)


@pytest.mark.parametrize("value", [[1, 2, 3], [0]])
def test_a_list_of_integers_is_read_as_given(value):
    assert IDS.read(value, "prompt") == value


@pytest.mark.parametrize("value", [[1, True], [1, 2.0], [1, "2"], [1, None], [], [[1]]])
def test_a_list_of_integers_refuses_anything_else(value):
    with pytest.raises(ApiError) as caught:
        IDS.read(value, "prompt")
    assert caught.value.status == 400 and caught.value.param == "prompt"


def test_the_prompt_kinds_pick_the_kind_that_accepts():
    assert PROMPT.read([5, 6], "prompt") == [5, 6]
    assert PROMPT.read([[5], [6, 7]], "prompt") == [[5], [6, 7]]
    assert PROMPT.read(["a", "b"], "prompt") == ["a", "b"]
    with pytest.raises(ApiError):
        PROMPT.read([5, "a"], "prompt")


def test_strings_in_a_list_are_still_checked_one_by_one():
    with pytest.raises(ApiError) as caught:
        ListOf(STRING, "strings").read(["ok", "a\ud800b"], "stop")
    assert caught.value.param == "stop[1]" and "surrogate" in caught.value.message


def test_prune_reaches_objects_inside_lists_and_leaves_scalar_lists_alone():
    message = ObjectOf([Field("role", STRING), Field("content", STRING)])
    fields = [Field("messages", ListOf(message, "messages")), Field("ids", ListOf(INTEGER, "ids")),
              Field("either", AnyOf(STRING, ListOf(message, "messages")))]
    body = {"messages": [{"role": "user", "content": "hi", "name": "x"}], "ids": [1, 2], "either": [{"role": "a", "y": 1}],
            "extra": 1}
    kept, ignored = prune(body, fields)
    assert kept == {"messages": [{"role": "user", "content": "hi"}], "ids": [1, 2], "either": [{"role": "a"}]}
    assert ignored == ["messages[0].name", "either[0].y", "extra"]
    assert parse(kept, fields)["ids"] == [1, 2]
