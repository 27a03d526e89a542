"""A replay of recent generation rounds for the online implicit PRM (``prm_replay_rounds``).

PRIME (arXiv 2502.01456, Algorithm 1 line 8) updates the implicit PRM on the rollouts of the current round only. With
few kept groups per round (most of them one right completion of ``K``), each update sees a handful of positive rows.
:class:`PrmReplay` keeps the labelled rows of the last ``rounds`` rounds, so that each cross-entropy update also trains
on them: their token ids, masks, PRM labels and reference log-probs (the reference is frozen, so those stay exact);
the PRM's own log-probs are recomputed with its current weights at every update. The window is kept in CPU memory and
moved to the PRM's device for each update.

A round joins the window only once its PRM step is taken: a step dropped by the guards (a poisoned batch, a skipped
policy step) leaves the window as it was. Each process keeps the rows it scored; a checkpoint saves every process's
window (``prm_replay_<process index>.pt``) and a resumed run restores it.
"""

from __future__ import annotations

import os
import warnings
from collections import deque

import torch


REPLAY_STATE_NAME = "prm_replay_{}.pt"
ROW_FIELDS = ("input_ids", "attention_mask", "completion_mask", "labels", "ref_logps")


def _moved(value, device):
    """A tensor copied to ``device`` (detached), or a list (``num_images``, ``num_tiles``) copied."""
    return value.detach().to(device, copy=True) if torch.is_tensor(value) else list(value)


def select_rows(batch: dict, rows: torch.Tensor, select_mm, device: str | torch.device = "cpu") -> dict:
    """The ``rows`` (a 1-D index tensor) of a round's ``batch`` (:data:`ROW_FIELDS` tensors with a leading row
    dimension, and ``mm``: the multimodal inputs, selected with ``select_mm(mm, rows)``), detached copies on
    ``device``."""
    out = {k: _moved(batch[k][rows], device) for k in ROW_FIELDS}
    out["mm"] = {k: _moved(v, device) for k, v in select_mm(batch.get("mm") or {}, rows).items()}
    return out


def to_device(batch: dict, device: torch.device) -> dict:
    """A stored ``batch`` with its tensors on ``device`` (lists as they are)."""
    out = {k: batch[k].to(device) for k in ROW_FIELDS}
    out["mm"] = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch["mm"].items()}
    return out


class PrmReplay:
    """A sliding window of the last ``rounds`` generation rounds' PRM training rows, on this process.

    Args:
        rounds: how many earlier rounds an update replays (``prm_replay_rounds``); ``0`` keeps nothing.

    A round's rows are :meth:`stage`\\ d after its PRM update and join the window on :meth:`commit` (its step taken)
    or are dropped on :meth:`drop` (its step dropped). :meth:`batches` gives the window, oldest first.
    """

    def __init__(self, rounds: int):
        if rounds < 0:
            raise ValueError(f"`prm_replay_rounds`={rounds} must be >= 0 (0 turns the replay off).")
        self.rounds = rounds
        self._window: deque[dict] = deque(maxlen=max(rounds, 1))
        self._staged: dict | None = None

    def __len__(self) -> int:
        return len(self._window) if self.rounds else 0

    def batches(self) -> list[dict]:
        """The replayed rounds, oldest first (each a dict of :data:`ROW_FIELDS` and ``mm``)."""
        return list(self._window) if self.rounds else []

    def stage(self, batch: dict) -> None:
        """Hold a round's rows until its PRM step is taken (:meth:`commit`) or dropped (:meth:`drop`)."""
        if self.rounds:
            self._staged = batch

    def commit(self) -> None:
        if self._staged is not None:
            self._window.append(self._staged)
        self._staged = None

    def drop(self) -> None:
        self._staged = None

    def state_dict(self) -> dict:
        return {"rounds": self.rounds, "window": list(self._window)}

    def load_state_dict(self, state: dict) -> None:
        self._window = deque(state["window"][-max(self.rounds, 1) :], maxlen=max(self.rounds, 1))
        self._staged = None

    def save(self, checkpoint_dir: str, process_index: int) -> None:
        """Write this process's window into ``checkpoint_dir`` (nothing when the replay is off)."""
        if self.rounds:
            torch.save(self.state_dict(), os.path.join(checkpoint_dir, REPLAY_STATE_NAME.format(process_index)))

    def load(self, checkpoint_dir: str, process_index: int) -> None:
        """Restore this process's window from ``checkpoint_dir``. A checkpoint without one (saved with the replay off,
        or by fewer processes) starts an empty window, with a warning."""
        if not self.rounds:
            return
        path = os.path.join(checkpoint_dir, REPLAY_STATE_NAME.format(process_index))
        if not os.path.isfile(path):
            warnings.warn(
                f"`prm_replay_rounds`={self.rounds} but {checkpoint_dir} holds no {os.path.basename(path)} (saved with "
                "the replay off, or by fewer processes): the PRM's replay starts empty.",
                stacklevel=2,
            )
            return
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.load_state_dict(state)
