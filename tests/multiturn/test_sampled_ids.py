"""The multi-turn invariant by hand: trained tokens must be sampled tokens, in order, with their log-probs."""

from __future__ import annotations

import pytest

from trellis.interfaces.agents import Trajectory
from trellis.interfaces.rollout import Generation
from trellis_multiturn.sampled import NotSampled, check_sampled


class Chars:
    """A tokenizer stand-in whose ids are character codes."""

    def decode(self, ids):
        return "".join(map(chr, ids))


def gen(text: str, lp: float = -0.5) -> Generation:
    return Generation([ord(c) for c in text], [lp] * len(text), "stop")


def conversation(*parts: tuple[str, Generation | str]) -> Trajectory:
    traj = Trajectory()
    for kind, part in parts:
        if kind == "model":
            traj.add_model(part)
        else:
            traj.add_environment([ord(c) for c in part])
    return traj


def test_turns_kept_verbatim_pass_and_environment_tokens_may_repeat_them():
    a, b = gen("ab"), gen("cd")
    check_sampled(conversation(("env", "cd"), ("model", a), ("env", "xy"), ("model", b)), [a, b], "loop", Chars())


def test_a_turn_may_be_dropped_or_kept_with_mask_zero():
    a, b = gen("ab"), gen("cd")
    check_sampled(conversation(("model", b)), [a, b], "loop", Chars())
    check_sampled(conversation(("env", "ab"), ("model", b)), [a, b], "loop", Chars())


def test_a_re_encoded_turn_is_refused_naming_the_loop_and_the_token():
    sampled = gen("ab")
    retokenized = Generation([ord("a"), ord("b"), ord("\n")], [-0.5] * 3, "stop")  # decode + encode added a newline
    with pytest.raises(NotSampled, match=r"agent loop 'retok' trains on token 10 \('\\n'\) at response position 2"):
        check_sampled(conversation(("model", retokenized)), [sampled], "retok", Chars())


def test_turns_out_of_order_or_with_other_log_probs_are_refused():
    a, b = gen("ab"), gen("cd")
    with pytest.raises(NotSampled, match="position 0"):  # "ab" matches after "cd", then "cd" has no copy after it
        check_sampled(conversation(("model", b), ("model", a)), [a, b], "loop", Chars())
    with pytest.raises(NotSampled, match="position 0"):
        check_sampled(conversation(("model", gen("ab", lp=-0.25))), [a], "loop", Chars())
