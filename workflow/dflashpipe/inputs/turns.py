"""The user turns of a chat that the target answers, in order: one notion for the expansion (which
regenerates every assistant turn of a multi-turn chat) and the evaluation (which decodes every user turn
of a multi-turn prompt after the target's own reply to the one before).

A row's user turns are those the corpus answers (the next turn is an assistant's) and its last turn; the
target's reply takes the place of the corpus's own.
"""

from __future__ import annotations

#: the roles of a chat regenerated turn by turn; a row with a turn of another role (a tool's) gets its last reply only
CHAT_ROLES = ("system", "user", "assistant")


def turn_plan(prompt: list[dict], turns: str) -> tuple[list[int], int, str | None]:
    """(indices of the user turns the target answers, the row's user turns, why it answers fewer, or None).

    A row's user turns are those the corpus answers (the next turn is an assistant's) and its last turn.
    ``turns: last``, or a row holding a turn of another role (a tool's), answers the last one only."""
    points = [i for i in range(len(prompt) - 1) if prompt[i]["role"] == "user" and prompt[i + 1]["role"] == "assistant"]
    points.append(len(prompt) - 1)
    if len(points) > 1 and turns == "last":
        return points[-1:], len(points), "turns_last"
    if len(points) > 1 and any(t["role"] not in CHAT_ROLES for t in prompt):
        return points[-1:], len(points), "tool_turns"
    return points, len(points), None


def next_turns(prompt: list[dict], points: list[int], k: int) -> list[dict]:
    """The corpus turns up to user turn ``points[k]`` that follow the reply to ``points[k - 1]`` (the corpus's
    own reply to it left out: the target's takes its place)."""
    if k == 0:
        return [dict(t) for t in prompt[: points[0] + 1]]
    turns = prompt[points[k - 1] + 1 : points[k] + 1]
    while turns[0]["role"] == "assistant":
        turns = turns[1:]
    return [dict(t) for t in turns]
