"""The learning benchmark's oracle process reward (issue 26, item 8): exact per-step correctness of the addition
task's completions, hand-computed, and the token rewards the ``prime_rloo_oracle`` trainer hands to Eq. 5."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest
from helpers import ROOT


sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
lt = pytest.importorskip("learning_task")

OPERANDS = [7, 8, 6, 9]  # running sums 15, 21, 30
RIGHT = "7 + 8 = 15\n\n15 + 6 = 21\n\n21 + 9 = 30\n\n\\boxed{30}"


def _chars(text: str, eos: bool = True) -> list[str]:
    """One piece per character (the benchmark's tokenizer), plus the EOS decoded to ""."""
    return [*text, *([""] if eos else [])]


def _only(rewards: list[float]) -> dict[int, float]:
    return {i: v for i, v in enumerate(rewards) if v != 0.0}


def test_gold_steps_and_operands():
    assert lt.gold_steps(OPERANDS) == ["7 + 8 = 15", "15 + 6 = 21", "21 + 9 = 30", "\\boxed{30}"]
    assert lt.parse_operands("Add: 7 + 8 + 6 + 9\n") == OPERANDS
    assert lt.parse_operands("<|im_start|>user\nAdd: 12 + 5\n") == [12, 5]
    with pytest.raises(ValueError, match="not a prompt"):
        lt.parse_operands("Add: 7\n")


def test_right_completion_gets_zero_everywhere():
    rewards = lt.oracle_step_rewards(_chars(RIGHT), OPERANDS)
    assert len(rewards) == len(RIGHT) + 1 and _only(rewards) == {}


def test_first_slip_gets_the_penalty_at_its_last_token_and_later_steps_nothing():
    # step 2 slips (22 for 21); step 3 adds right from the written sum (22 + 9 = 31) and the boxed answer follows it:
    # only the first wrong step is penalised, at its last character "2" = index 10 + 2 + 11 - 1 = 22
    text = "7 + 8 = 15\n\n15 + 6 = 22\n\n22 + 9 = 31\n\n\\boxed{31}"
    assert text[22] == "2" and text[23:25] == "\n\n"
    assert _only(lt.oracle_step_rewards(_chars(text), OPERANDS)) == {22: -1.0}
    assert _only(lt.oracle_step_rewards(_chars(text), OPERANDS, penalty=0.5)) == {22: -0.5}


def test_first_step_slip_and_wrong_operand():
    text = "7 + 8 = 16\n\n16 + 6 = 22\n\n22 + 9 = 31\n\n\\boxed{31}"
    assert _only(lt.oracle_step_rewards(_chars(text), OPERANDS)) == {9: -1.0}
    # a right sum of a wrong operand (15 + 5 = 20) is a wrong step too
    text = "7 + 8 = 15\n\n15 + 5 = 20\n\n20 + 9 = 29\n\n\\boxed{29}"
    assert _only(lt.oracle_step_rewards(_chars(text), OPERANDS)) == {22: -1.0}


def test_wrong_boxed_answer_after_right_steps():
    text = RIGHT.replace("\\boxed{30}", "\\boxed{31}")
    assert _only(lt.oracle_step_rewards(_chars(text), OPERANDS)) == {len(text) - 1: -1.0}  # the "}"


def test_stopping_early_is_penalised_on_the_eos():
    text = "7 + 8 = 15\n\n15 + 6 = 21"
    assert _only(lt.oracle_step_rewards(_chars(text), OPERANDS)) == {len(text): -1.0}  # the EOS piece
    # truncated (no EOS): the last token
    assert _only(lt.oracle_step_rewards(_chars(text, eos=False), OPERANDS)) == {len(text) - 1: -1.0}
    assert lt.oracle_step_rewards([], OPERANDS) == []


def test_multi_character_pieces_map_to_their_token_and_whitespace_is_tolerated():
    # a third blank line before step 2 is stripped; the slip of step 3 ends in the piece "2\n\n" (index 3)
    pieces = ["7 + 8 = 15\n\n", "\n15 + 6 = 21\n\n", "21 + 9 = 3", "2\n\n", "\\boxed{32}", ""]
    assert _only(lt.oracle_step_rewards(pieces, OPERANDS)) == {3: -1.0}


def test_oracle_trainer_hook_on_padded_batch():
    """The trainer's ``_token_rewards``: the task's tokenizer decodes each completion token, EOS and padding carry
    no reward, the penalty lands on the right position, and the sequence rewards are the row sums."""
    torch = pytest.importorskip("torch")
    tok = lt.build_tokenizer()
    prompts = ["Add: 7 + 8 + 6 + 9\n", "Add: 1 + 2\n"]
    completions = [RIGHT.replace("= 21\n\n21 + 9 = 30", "= 22\n\n22 + 9 = 31").replace("{30}", "{31}"), "1 + 2 = 3"]
    enc = tok(prompts, return_tensors="pt", padding=True)
    rows = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in completions]
    T = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    trainer_cls = lt.OracleRLOOTrainer
    stub = SimpleNamespace(_tokenizer=tok, oracle_penalty=1.0)
    r = SimpleNamespace(actions=mask)
    out, seq = trainer_cls._token_rewards(stub, {"prompt_ids": enc["input_ids"], "completion_ids": ids}, r)
    assert out.shape == (2, T)
    assert out[0].nonzero().flatten().tolist() == [22] and out[0, 22].item() == -1.0
    # "1 + 2 = 3" stops before "\boxed{3}": the penalty on its EOS (index 9); the padding after it stays 0
    assert out[1].nonzero().flatten().tolist() == [9] and out[1, 9].item() == -1.0
    assert seq.tolist() == [-1.0, -1.0]
