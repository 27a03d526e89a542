"""Forward passes per PRIME step (issue 7): counted with module hooks on the policy, the PRM and its reference.

Per generation round PRIME adds exactly one reference forward and one PRM forward + backward (``prm_update="single"``;
``"double"`` adds one no-grad PRM forward) to the policy's own loss forward; it runs no rollout (old) log-prob forward
when TRL's GRPO would skip it (``num_iterations=1``, generation aligned with the optimizer step) -- also on RLOO, whose
TRL trainer always runs one. Reference log-probs are computed once per rollout batch and shared by everything that
reads them: the PRM loss and rewards, every gradient-accumulation micro-batch, and TRL's KL term when ``beta > 0``.
The PRM and reference log-probs never materialise ``(B, T, V)`` logits (TRL's chunked fused LM head).
Also: a PRM smaller than the policy (``prm_model``, same tokenizer) whose reference is that smaller checkpoint.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.utils._python_dispatch
from helpers import tiny_config
from tiny import build_tokenizer, contains_reward, tiny_prompt_dataset, tiny_qwen2_config

from trl_prime import PrimeGRPOConfig, PrimeGRPOTrainer, PrimeRLOOConfig, PrimeRLOOTrainer
from trl_prime.callbacks import PrimeCallback
from trl_prime.modeling import unwrap


K = 4
B = 8  # rows of a generation round (per_device_train_batch_size * steps_per_generation)


def _config(cfg_cls, tmp_path, **overrides):
    return tiny_config(
        cfg_cls,
        tmp_path,
        **{
            "per_device_train_batch_size": B,
            "max_steps": 2,
            "prm_learning_rate": 1e-2,
            "filter_lower": 0.0,
            "filter_upper": 1.0,
            **overrides,
        },
    )


class ForwardCounter:
    """Counts forward calls and scored rows of each model role, per optimizer step, outside generation.

    ``model_roles``: ``{role: module}``. A PEFT model is one module for several roles: its calls are classified by
    the active adapter (``"default"`` = policy, ``"prm"`` = PRM, adapters disabled = reference ``"base"``).
    Generation calls (``use_cache=True`` / a cache) are not counted. Each record: ``(step, role, grad, rows)``.
    Backward passes are counted per role by a gradient hook on the output of each forward run with grad.
    """

    def __init__(self, trainer, model_roles: dict):
        self.trainer = trainer
        self.records = []
        self.backwards = collections.Counter()
        for role, module in model_roles.items():
            unwrap(module).register_forward_hook(self._hook(role), with_kwargs=True)

    @property
    def prm_backwards(self):
        return collections.Counter({s: n for (s, role), n in self.backwards.items() if role == "prm"})

    def _hook(self, role):
        def hook(module, args, kwargs, output):
            if kwargs.get("use_cache") is True or kwargs.get("cache") is not None or kwargs.get("past_key_values"):
                return  # generation
            name = role
            if role == "peft":
                from peft.tuners.tuners_utils import BaseTunerLayer

                layer = next(m for m in module.modules() if isinstance(m, BaseTunerLayer))
                name = "base" if layer.disable_adapters else "+".join(layer.active_adapters)
                name = {"default": "policy", "prm": "prm", "base": "ref"}.get(name, name)
            ids = kwargs.get("input_ids", args[0] if args else None)
            step = self.trainer.state.global_step + 1
            self.records.append((step, name, torch.is_grad_enabled(), ids.size(0)))
            out = getattr(output, "log_probs", None)
            out = output.logits if out is None else out
            if out.requires_grad:
                out.register_hook(lambda g: self.backwards.update([(step, name)]))

        return hook

    def rows(self, step, role, grad):
        return sum(r for s, n, g, r in self.records if s == step and n == role and g == grad)

    def calls(self, step, role, grad):
        return sum(1 for s, n, g, r in self.records if s == step and n == role and g == grad)


def _trainer(cls, cfg_cls, model, tmp_path, reward=None, callbacks=None, peft_config=None, **overrides):
    """``cls`` (a PRIME trainer or a subclass) on 16 tiny prompts, :func:`_config` of ``cfg_cls`` with ``overrides``
    (reward: contains "e")."""
    return cls(
        model=model,
        reward_funcs=reward or contains_reward("e"),
        train_dataset=tiny_prompt_dataset(16),
        args=_config(cfg_cls, tmp_path, **overrides),
        callbacks=callbacks,
        peft_config=peft_config,
    )


def _separate_counter(tr):
    roles = {"policy": tr.model, "prm": tr.prm_model}
    ref = tr.implicit_prm.ref_model
    if ref is not None:
        roles["ref"] = ref
    return ForwardCounter(tr, roles)


@pytest.mark.parametrize(
    "cls,cfg_cls,prm_update",
    [
        (PrimeRLOOTrainer, PrimeRLOOConfig, "single"),
        (PrimeRLOOTrainer, PrimeRLOOConfig, "double"),
        (PrimeGRPOTrainer, PrimeGRPOConfig, "single"),
    ],
    ids=["rloo-single", "rloo-double", "grpo-single"],
)
def test_forward_passes_per_prime_step(tiny_model_path, tmp_path, cls, cfg_cls, prm_update):
    """num_iterations=1: one reference forward, one PRM forward + backward (+1 no-grad PRM forward for "double"),
    the policy's loss forward, and no old-log-prob forward (TRL's RLOO runs one; PRIME's token-level loss skips it)."""
    tr = _trainer(cls, cfg_cls, tiny_model_path, tmp_path, prm_update=prm_update)
    assert tr.implicit_prm.reference == "model" and tr.ref_model is None
    c = _separate_counter(tr)
    tr.train()
    for step in (1, 2):
        assert c.rows(step, "ref", False) == B and c.calls(step, "ref", True) == 0
        assert c.calls(step, "prm", True) == 1 and c.rows(step, "prm", True) == B
        assert c.rows(step, "prm", False) == (B if prm_update == "double" else 0)
        assert c.prm_backwards[step] == 1 and c.backwards[(step, "policy")] == 1
        assert c.rows(step, "policy", True) == B  # the loss
        assert c.calls(step, "policy", False) == 0  # no rollout log-prob forward
    assert len({s for s, *_ in c.records}) == 2


def test_prm_micro_batches_scan_each_row_once(tiny_model_path, tmp_path):
    tr = _trainer(PrimeRLOOTrainer, PrimeRLOOConfig, tiny_model_path, tmp_path, prm_micro_batch_size=3, max_steps=1)
    c = _separate_counter(tr)
    tr.train()
    assert c.calls(1, "ref", False) == 3 and c.rows(1, "ref", False) == B  # 3 + 3 + 2 rows
    assert c.calls(1, "prm", True) == 3 and c.rows(1, "prm", True) == B
    assert c.prm_backwards[1] == 3  # one backward per micro-batch (ce loss), one optimizer step
    assert tr.prm_optim.num_updates == 1


def _half_kept_reward(prompts, completions, **kwargs):
    """Even groups: outcomes 0, 1, 0, 1 (accuracy 0.5: kept); odd groups: all 0 (filtered out by 0.2..0.8)."""
    return [float(i % 2) if (i // K) % 2 == 0 else 0.0 for i in range(len(completions))]


class _Capture(PrimeCallback):
    """Clones of the tensors ``keys`` of every ``on_rollouts_scored`` payload, in ``.rounds``."""

    def __init__(self, *keys):
        self.keys, self.rounds = keys, []

    def on_rollouts_scored(self, args, state, control, **kw):
        self.rounds.append({k: kw[k].clone() for k in self.keys})


def test_filtered_rows_get_a_no_grad_prm_forward_only(tiny_model_path, tmp_path):
    """The PRM trains on kept rows only: they get the forward with grad (+ backward); the filtered rows need their
    log-probs for token rewards and metrics only, so they get one no-grad forward (no activations, no backward)."""
    from trl_prime.modeling import completion_logps

    capture = _Capture("kept_mask", "prm_logps", "prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    tr = _trainer(
        PrimeRLOOTrainer,
        PrimeRLOOConfig,
        tiny_model_path,
        tmp_path,
        reward=_half_kept_reward,
        callbacks=[capture],
        filter_lower=0.2,
        filter_upper=0.8,
        max_steps=1,
    )
    prm = unwrap(tr.prm_model)
    prm0 = {k: v.clone() for k, v in prm.state_dict().items()}
    c = _separate_counter(tr)
    tr.train()
    seen = capture.rounds[-1]
    assert seen["kept_mask"].tolist() == [True] * K + [False] * K
    assert c.rows(1, "prm", True) == K and c.calls(1, "prm", True) == 1  # kept rows: forward with grad
    assert c.rows(1, "prm", False) == K and c.calls(1, "prm", False) == 1  # filtered rows: one no-grad forward
    assert c.prm_backwards[1] == 1 and tr.prm_optim.num_updates == 1
    assert any(not torch.equal(v, prm0[k]) for k, v in prm.state_dict().items())  # the PRM did move
    # every row's log-probs (kept and filtered) are those of the PRM before its update (single forward)
    prm.load_state_dict(prm0)
    ids = torch.cat([seen["prompt_ids"], seen["completion_ids"]], 1)
    mask = torch.cat([seen["prompt_mask"], seen["completion_mask"]], 1)
    with torch.no_grad():
        expected = completion_logps(prm, ids, mask, seen["completion_ids"].size(1))
    cm = seen["completion_mask"].bool()
    torch.testing.assert_close(seen["prm_logps"][cm], expected[cm], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prm_update", ["single", "double"])
def test_unscored_filtered_rows_get_no_reference_or_prm_forward(tiny_model_path, tmp_path, prm_update):
    """prm_score_filtered_rows=False: the filtered rows get neither the reference forward nor the PRM forward; the
    kept rows' token rewards and advantages, the PRM update and the policy update are those of the default run;
    callbacks see NaN token rewards / log-probs on the filtered rows and the token-reward metrics cover kept rows."""
    import json

    from trl_prime.callbacks import TokenRewardLogger

    def run(score: bool, name: str):
        keys = ("kept_mask", "token_rewards", "sequence_rewards", "prm_logps", "ref_logps", "advantages", "loss_mask")
        capture = _Capture(*keys)
        logger = TokenRewardLogger(every_n_steps=1, num_completions=B, output_dir=str(tmp_path / name))
        tr = _trainer(
            PrimeRLOOTrainer,
            PrimeRLOOConfig,
            tiny_model_path,
            tmp_path / name,
            reward=_half_kept_reward,
            callbacks=[capture, logger],
            filter_lower=0.2,
            filter_upper=0.8,
            prm_update=prm_update,
            prm_score_filtered_rows=score,
        )
        c = _separate_counter(tr)
        tr.train()
        flat = lambda m: torch.cat([p.detach().flatten() for p in unwrap(m).parameters()])  # noqa: E731
        logs = [h for h in tr.state.log_history if "prm/token_reward_mean" in h]
        return c, capture.rounds, flat(tr.model), flat(tr.prm_model), logs

    c, seen, policy, prm, logs = run(False, "unscored")
    c0, seen0, policy0, prm0, logs0 = run(True, "scored")
    kept = torch.tensor([True] * K + [False] * K)
    for step in (1, 2):
        assert c.rows(step, "ref", False) == K and c0.rows(step, "ref", False) == B
        assert c.rows(step, "prm", True) == K and c.prm_backwards[step] == 1
        assert c.rows(step, "prm", False) == (K if prm_update == "double" else 0)  # "double": kept rows re-scored
        assert c0.rows(step, "prm", False) == (K + B if prm_update == "double" else K)  # filtered rows (+ re-score)
    for r, r0 in zip(seen, seen0):
        assert r["kept_mask"].tolist() == kept.tolist()
        for key in ("token_rewards", "prm_logps", "ref_logps"):
            assert torch.isnan(r[key][~kept]).all(), key
            torch.testing.assert_close(r[key][kept], r0[key][kept], rtol=1e-5, atol=1e-6)
        assert torch.isnan(r["sequence_rewards"][~kept]).all()
        torch.testing.assert_close(r["advantages"], r0["advantages"], rtol=1e-5, atol=1e-6)
        assert torch.equal(r["loss_mask"], r0["loss_mask"])
    assert seen[1]["token_rewards"][kept].abs().max() > 0  # the PRM moved after step 1
    torch.testing.assert_close(policy, policy0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(prm, prm0, rtol=1e-5, atol=1e-6)
    # the token-reward metrics cover the kept (scored) rows only
    mask = seen[1]["loss_mask"].sum(-1) > 0
    cm = torch.ones_like(seen[1]["token_rewards"], dtype=torch.bool)
    kept_tokens = seen[1]["token_rewards"][mask.unsqueeze(1) & cm & ~torch.isnan(seen[1]["token_rewards"])]
    assert logs[1]["prm/token_reward_max"] == pytest.approx(kept_tokens.max().item(), rel=1e-4, abs=1e-6)

    # TokenRewardLogger writes strict JSON: null rewards on the unscored (filtered) rows, numbers on the kept ones
    def strict(x):
        raise ValueError(f"non-strict JSON constant {x}")

    lines = [json.loads(x, parse_constant=strict) for x in open(tmp_path / "unscored" / "token_rewards.jsonl")]
    assert len(lines) == 2 * B
    for rec in lines:
        is_kept = rec["index"] < K
        assert rec["kept"] is is_kept and (rec["sequence_reward"] is None) is (not is_kept)
        assert all((t["reward"] is None) is (not is_kept) for t in rec["tokens"]) and rec["tokens"]


@pytest.mark.parametrize(
    "cls,cfg_cls,loss_type",
    [
        (PrimeRLOOTrainer, PrimeRLOOConfig, None),
        (PrimeGRPOTrainer, PrimeGRPOConfig, "dapo"),
        (PrimeGRPOTrainer, PrimeGRPOConfig, "bnpo"),
        (PrimeGRPOTrainer, PrimeGRPOConfig, "grpo"),
    ],
    ids=["rloo", "grpo-dapo", "grpo-bnpo", "grpo-grpo"],
)
def test_policy_loss_skips_filtered_rows_with_the_same_update(
    tiny_model_path, tmp_path, monkeypatch, cls, cfg_cls, loss_type
):
    """Rows of filtered prompts have loss weight 0: the policy's loss forward and backward run on the kept rows only
    (4 of 8 here), and the update is the one the whole micro-batch gives (same losses, same weights after 2 steps as
    with the row dropping turned off). TRL's "grpo" loss divides by the number of rows, so it keeps every row."""
    import trl_prime.adapters as adapters
    import trl_prime.rollout as rollout

    def run(drop: bool, name: str):
        if not drop:
            monkeypatch.setattr(adapters, "drop_zero_weight_rows", lambda inputs, weight, accelerator=None: inputs)
            monkeypatch.setattr(rollout, "drop_zero_weight_rows", lambda inputs, weight, accelerator=None: inputs)
        extra = {} if loss_type is None else {"loss_type": loss_type}
        tr = _trainer(
            cls,
            cfg_cls,
            tiny_model_path,
            tmp_path / name,
            reward=_half_kept_reward,
            filter_lower=0.2,
            filter_upper=0.8,
            **extra,
        )
        c = _separate_counter(tr)
        flat = lambda: torch.cat([p.detach().flatten().clone() for p in unwrap(tr.model).parameters()])  # noqa: E731
        before = flat()
        tr.train()
        monkeypatch.undo()
        losses = [h["loss"] for h in tr.state.log_history if "loss" in h and "train_runtime" not in h]
        return c, before, flat(), losses

    c_drop, w0, w_drop, l_drop = run(True, "drop")
    c_full, _, w_full, l_full = run(False, "full")
    kept_rows = B if loss_type == "grpo" else K
    for step in (1, 2):
        assert c_drop.rows(step, "policy", True) == kept_rows and c_drop.calls(step, "policy", True) == 1
        assert c_full.rows(step, "policy", True) == B
        assert c_drop.backwards[(step, "policy")] == 1
    assert len(l_drop) == 2 and l_drop[-1] != 0.0  # (GRPO step 1: ratio 1, group-normalised advantages: loss 0)
    torch.testing.assert_close(torch.tensor(l_drop), torch.tensor(l_full), rtol=1e-5, atol=1e-7)
    assert not torch.equal(w0, w_drop)  # the policy trained
    torch.testing.assert_close(w_drop, w_full, rtol=1e-5, atol=1e-6)


def test_drop_zero_weight_rows():
    """Row-aligned tensors lose their zero-weight rows (order kept); 0-dim tensors and non-tensors pass through; at
    least one row stays; multimodal batches, batches with (row-aligned) lists and fully weighted ones are returned as
    they are; the input is not modified."""
    from trl_prime.rollout import drop_zero_weight_rows

    w = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0]])
    inputs = {
        "completion_ids": torch.arange(12).view(4, 3),
        "advantages": torch.tensor([0.5, -1.0, 2.0, 3.0]),
        "num_items_in_batch": torch.tensor(3),
        "note": "x",
    }
    out = drop_zero_weight_rows(inputs, w)
    assert out["completion_ids"].tolist() == [[0, 1, 2], [6, 7, 8]]
    assert out["advantages"].tolist() == [0.5, 2.0]
    assert out["num_items_in_batch"].item() == 3 and out["note"] == "x"
    assert inputs["completion_ids"].shape == (4, 3)  # unchanged
    dead = drop_zero_weight_rows(inputs, torch.zeros(4, 3))
    assert dead["completion_ids"].tolist() == [[0, 1, 2]] and dead["advantages"].tolist() == [0.5]
    assert drop_zero_weight_rows(inputs, torch.ones(4, 3)) is inputs
    assert drop_zero_weight_rows({**inputs, "pixel_values": torch.zeros(7, 2)}, w)["completion_ids"].shape == (4, 3)
    assert drop_zero_weight_rows({**inputs, "tags": ["a", "b", "c", "d"]}, w)["completion_ids"].shape == (4, 3)


@pytest.mark.parametrize(
    "cls,cfg_cls", [(PrimeRLOOTrainer, PrimeRLOOConfig), (PrimeGRPOTrainer, PrimeGRPOConfig)], ids=["rloo", "grpo"]
)
def test_reference_once_per_rollout_batch_with_gradient_accumulation(tiny_model_path, tmp_path, cls, cfg_cls):
    """gradient_accumulation_steps=2: one generation round of 8 rows feeds two loss micro-batches of 4; the
    reference and the PRM see each row once per round, not once per micro-batch."""
    tr = _trainer(
        cls, cfg_cls, tiny_model_path, tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2
    )
    c = _separate_counter(tr)
    tr.train()
    for step in (1, 2):
        assert c.rows(step, "ref", False) == B
        assert c.rows(step, "prm", True) == B and c.rows(step, "prm", False) == 0
        assert c.calls(step, "policy", True) == 2 and c.rows(step, "policy", True) == B
        assert c.calls(step, "policy", False) == 0
    assert tr.prm_optim.num_updates == 2


def test_old_logps_kept_when_the_policy_moves_between_generation_and_loss(tiny_model_path, tmp_path):
    """steps_per_generation=2 > gradient_accumulation_steps=1: the second step trains on rollouts of the previous
    policy, so the rollout log-probs are needed (one no-grad policy forward per generation round) and reach the loss."""
    seen = []

    class Spy(PrimeRLOOTrainer):
        def _compute_loss(self, model, inputs):
            seen.append(inputs.get("old_per_token_logps"))
            return super()._compute_loss(model, inputs)

    tr = _trainer(
        Spy, PrimeRLOOConfig, tiny_model_path, tmp_path, per_device_train_batch_size=4, steps_per_generation=2
    )
    assert not tr._skips_rollout_logps()
    c = _separate_counter(tr)
    tr.train()
    assert c.rows(1, "policy", False) == B and c.rows(2, "policy", False) == 0  # generated once, at step 1
    assert c.rows(1, "ref", False) == B and c.rows(2, "ref", False) == 0
    assert all(o is not None for o in seen)


@pytest.mark.parametrize(
    "cls,cfg_cls", [(PrimeRLOOTrainer, PrimeRLOOConfig), (PrimeGRPOTrainer, PrimeGRPOConfig)], ids=["rloo", "grpo"]
)
def test_kl_reference_is_the_prm_reference(tiny_model_path, tmp_path, cls, cfg_cls):
    """beta > 0: TRL's KL reference is the PRM's reference model; one reference forward serves both."""
    tr = _trainer(cls, cfg_cls, tiny_model_path, tmp_path, beta=0.1)
    assert tr.implicit_prm.ref_model is tr.ref_model
    c = _separate_counter(tr)
    tr.train()
    for step in (1, 2):
        assert c.rows(step, "ref", False) == B
        assert c.rows(step, "prm", True) == B
        # RLOO's KL-in-reward needs the rollout log-probs; GRPO's KL is in the loss
        assert c.rows(step, "policy", False) == (B if cls is PrimeRLOOTrainer else 0)


@pytest.mark.parametrize(
    "cls,cfg_cls,beta",
    [
        (PrimeRLOOTrainer, PrimeRLOOConfig, 0.0),
        (PrimeRLOOTrainer, PrimeRLOOConfig, 0.1),
        (PrimeGRPOTrainer, PrimeGRPOConfig, 0.1),
    ],
    ids=["rloo-beta0", "rloo-kl", "grpo-kl"],
)
def test_lora_shared_base_forward_counts(tiny_model_path, tmp_path, cls, cfg_cls, beta):
    """One base model: policy (adapter "default"), PRM (adapter "prm") and reference (adapters disabled). With
    beta > 0 TRL's KL reference is that same base: one reference forward per round, shared (scored in eval mode)."""
    from peft import LoraConfig

    rec = {}

    class Spy(cls):
        def _algorithm_step(self, output, rollout):
            rec.setdefault("trl_ref", []).append(rollout.capture.get("trl_ref_logps"))
            return super()._algorithm_step(output, rollout)

    tr = _trainer(
        Spy,
        cfg_cls,
        tiny_model_path,
        tmp_path,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        beta=beta,
    )
    assert tr.implicit_prm.reference == "adapters_disabled"
    c = ForwardCounter(tr, {"peft": tr.model})
    tr.train()
    for step in (1, 2):
        assert c.rows(step, "ref", False) == B and c.calls(step, "ref", True) == 0
        assert c.rows(step, "prm", True) == B and c.rows(step, "prm", False) == 0
        assert c.prm_backwards[step] == 1
        assert c.rows(step, "policy", True) == B
        assert c.rows(step, "policy", False) == (B if (cls is PrimeRLOOTrainer and beta != 0) else 0)
    if beta != 0:
        assert tr._shares_trl_ref and all(r is not None for r in rec["trl_ref"])


# ----------------------------------------------------------------------------------------------------------------
# No (B, T, V) tensor in the PRM / reference log-prob path
# ----------------------------------------------------------------------------------------------------------------
class LargestVocabTensor(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest numel of any op output whose last dimension is the vocabulary size."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.size(-1) == self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("peft", [False, True], ids=["separate-models", "lora-shared-base"])
def test_prm_and_reference_logps_never_materialise_full_vocab_logits(tiny_model_path, tmp_path, monkeypatch, peft):
    """With TRL's chunk sizes made small (16 tokens x 64 vocabulary entries per tile, vocabulary 320), the PRM
    forward + backward and the reference forward of a training step produce no tensor with the vocabulary as last
    dimension at all, let alone (B, T, V); the detector does flag a plain forward's logits."""
    import trl.kernels.chunked_logprob as chunked
    import trl.trainer.utils as trl_utils

    monkeypatch.setattr(chunked, "TOKEN_CHUNK_SIZE", 16)
    monkeypatch.setattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 64)
    kw = {}
    if peft:
        from peft import LoraConfig

        kw["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    tr = _trainer(
        PrimeRLOOTrainer, PrimeRLOOConfig, tiny_model_path, tmp_path, max_steps=1, max_completion_length=16, **kw
    )
    vocab = unwrap(tr.model).config.vocab_size
    seen = {}

    def watch(name, fn):
        def wrapped(*a, **k):
            with LargestVocabTensor(vocab) as mode:
                out = fn(*a, **k)
            seen[name] = max(seen.get(name, 0), mode.largest)
            return out

        return wrapped

    monkeypatch.setattr(tr.implicit_prm, "ref_logps", watch("ref", tr.implicit_prm.ref_logps))
    monkeypatch.setattr(tr, "_train_prm", watch("prm", tr._train_prm))
    tr.train()
    assert set(seen) >= {"ref", "prm"} and tr.prm_optim.num_updates == 1
    assert seen["ref"] == 0 and seen["prm"] == 0

    # the detector works: a plain forward of the same model materialises (B, L, V) logits
    ids = torch.randint(0, vocab, (B, 20))
    with torch.no_grad(), LargestVocabTensor(vocab) as mode:
        unwrap(tr.model)(input_ids=ids)
    assert mode.largest >= B * 19 * vocab


# ----------------------------------------------------------------------------------------------------------------
# A PRM smaller than the policy (same tokenizer)
# ----------------------------------------------------------------------------------------------------------------
def _build_small(path):
    """A smaller causal LM (hidden 32, 1 layer) sharing the tiny tokenizer of tests/tiny.py."""
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer()
    cfg = tiny_qwen2_config(tok, small=True, bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize(
    "cls,cfg_cls", [(PrimeRLOOTrainer, PrimeRLOOConfig), (PrimeGRPOTrainer, PrimeGRPOConfig)], ids=["rloo", "grpo"]
)
def test_smaller_prm_checkpoint_is_its_own_reference(tiny_model_path, tmp_path, cls, cfg_cls):
    """`prm_model` names a smaller checkpoint with the policy's tokenizer: the PRM and its frozen reference are that
    checkpoint (rewards exactly 0 at step 1), the PRM trains, the reference does not, and counts stay one each."""
    from trl_prime import ImplicitPRM

    small = _build_small(tmp_path / "small")
    rewards = []

    class Spy(cls):
        def _algorithm_step(self, output, cap):
            out = super()._algorithm_step(output, cap)
            rewards.append(out["prime_token_rewards"].clone())
            return out

    tr = _trainer(Spy, cfg_cls, tiny_model_path, tmp_path, prm_model=small, max_steps=2)
    prm, ref = tr.prm_model, unwrap(tr.implicit_prm.ref_model)
    assert prm.config.hidden_size == 32 and ref.config.hidden_size == 32
    assert unwrap(tr.model).config.hidden_size == 64
    ref0 = {k: v.clone() for k, v in ref.state_dict().items()}
    prm0 = {k: v.clone() for k, v in prm.state_dict().items()}
    c = _separate_counter(tr)
    tr.train()
    assert torch.equal(rewards[0], torch.zeros_like(rewards[0]))  # PRM == its reference before the first step
    assert rewards[1].abs().max() > 0
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in ref0.items())
    assert any(not torch.equal(v, prm.state_dict()[k]) for k, v in prm0.items())
    for step in (1, 2):
        assert c.rows(step, "ref", False) == B and c.rows(step, "prm", True) == B
        assert c.calls(step, "policy", False) == 0
    tr.save_model(str(tmp_path / "final"))
    loaded = ImplicitPRM.from_pretrained(str(tmp_path / "final" / "prm"))
    assert unwrap(loaded.model).config.hidden_size == 32
