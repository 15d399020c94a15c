"""The preference objectives' losses: pure functions over per-sequence log-probabilities.

Every log-probability here is in nats and belongs to one answer (completion) given its prompt: the sum over the
answer's tokens of ``log p(token | everything before it)``; the prompt and the padding do not count
(:func:`sequence_logps` makes these sums from token log-probs and a completion mask). ``[batch]`` is the number of
pairs (KTO: of examples). Chosen = preferred = ``y_w``, rejected = dispreferred = ``y_l``, ``r = log pi - log ref``.

Objectives (``s``: a summed log-prob, ``n``: answer tokens, ``a = s / n``, ``b``: beta, ``e``: label_smoothing,
``sig``: the logistic sigmoid), each with its paper and the TRL 1.16 code it is tested against:

- ``dpo``: ``-(1-e) log sig(b d) - e log sig(-b d)`` with ``d = r_w - r_l``. Rafailov et al. 2023, "Direct
  Preference Optimization" (arXiv 2305.18290) Eq. 7; ``e > 0`` is the conservative DPO of Mitchell 2023, "A note on
  DPO with noisy preferences and relationship to IPO". trl/trainer/dpo_trainer.py ``DPOTrainer._compute_loss``
  (``sigmoid``, which in 1.16 has no label smoothing) and experimental/cpo/cpo_trainer.py ``cpo_loss`` (which keeps
  the smoothed form).
- ``ipo``: ``(r_w / n_w - r_l / n_l - 1 / (2 b))^2``. Azar et al. 2023, "A General Theoretical Paradigm to
  Understand Learning from Human Preferences" (arXiv 2310.12036) Eq. 17, beta = the paper's tau; per answer token
  as TRL's dpo_trainer.py ``ipo`` does (its comment: confirmed with the IPO authors).
- ``simpo``: ``-(1-e) log sig(h) - e log sig(-h)`` with ``h = b (a_w - a_l - g)``, ``g = gamma_beta_ratio``;
  reference-free. Meng et al. 2024, "SimPO" (arXiv 2405.14734) Eq. 6. experimental/cpo/cpo_trainer.py ``simpo``.
- ``orpo``: ``-b log sig(log odds_w - log odds_l)`` with ``log odds = a - log(1 - exp(a))``, plus the NLL term;
  reference-free; beta = the paper's lambda. Hong et al. 2024, "ORPO" (arXiv 2403.07691) Eqs. 4-7.
  experimental/orpo/orpo_trainer.py ``odds_ratio_loss`` and ``log1mexp``.
- ``kto`` (unpaired): ``w_d (1 - sig(b (r - z)))`` for a desirable answer, ``w_u (1 - sig(b (z - r)))`` for an
  undesirable one, ``z`` the batch's KL estimate. Ethayarajh et al. 2024, "KTO" (arXiv 2402.01306), the loss
  TRL cites as its Eq. 7.
  trl/trainer/kto_trainer.py ``KTOTrainer._compute_loss``.

The NLL term (mean NLL per chosen answer token over the batch, ``-sum(s_w) / sum(n_w)``) is ORPO's SFT term
(weight 1, ``b`` = the paper's lambda on the odds-ratio term) and, weighted by ``rpo_alpha``, RPO's term on DPO, IPO
or SimPO (Pang et al. 2024, "Iterative Reasoning Preference Optimization", arXiv 2404.19733; in TRL 1.16:
``loss_type=["sigmoid", "sft"]`` with ``loss_weights=[1, alpha]``, and the CPO trainer's ``cpo_alpha``). TRL's ORPO
trainer counts the prompt tokens in that NLL too; qwenft counts only answer tokens, as in SFT.

Metrics carry TRL's names (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen``, ``logps/rejected``; KTO adds ``kl``; ORPO ``log_odds_ratio`` and ``log_odds_chosen``; an NLL term
``nll_loss``) and TRL's values: the reward is ``b r`` (DPO, IPO, KTO) or ``b a`` (SimPO, ORPO, where ``logps/*`` are
the per-token means ``a`` as TRL logs them). Everything is computed in at least float32 (float64 stays float64);
reference log-probs and KTO's KL estimate never get a gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from qwenft.config.train import REFERENCE_FREE  # the objectives without a reference model: one list, torch-free

OBJECTIVES = ("dpo", "ipo", "simpo", "orpo", "kto")
PAIRED = ("dpo", "ipo", "simpo", "orpo")
_LN2 = 0.6931471805599453


@dataclass(frozen=True)
class PreferenceLoss:
    """One batch's loss.

    Attributes:
        loss: ``[]`` the value to backpropagate: ``losses.mean()`` plus the batch's NLL term where there is one.
        losses: ``[batch]`` the objective's loss per pair (KTO: per example, in input order, weights applied),
            without the NLL term (a batch-level token mean, not a per-pair quantity).
        metrics: detached ``[]`` tensors under TRL's names (module docstring), means over the batch.
    """

    loss: torch.Tensor
    losses: torch.Tensor
    metrics: Dict[str, torch.Tensor]


def needs_reference(objective: str) -> bool:
    """Whether ``objective`` needs the reference model's log-probs (SimPO and ORPO do not: skip the reference forward).

    Raises:
        ValueError: an unknown ``objective``.
    """
    _check_objective(objective, OBJECTIVES)
    return objective not in REFERENCE_FREE


def sequence_logps(token_logps: torch.Tensor, completion_mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence sums of the answer tokens' log-probs, and the answers' lengths.

    ``token_logps[b, t]`` and ``completion_mask[b, t]`` describe the same token: for a causal LM, the log-probs of
    ``input_ids[:, 1:]`` from ``logits[:, :-1]`` go with ``completion_mask[:, 1:]``. Masked positions (prompt,
    padding) count as nothing, whatever they hold (-inf and NaN included), and pass no gradient.

    Args:
        token_logps: ``[batch, seq]`` log-probs in nats (float).
        completion_mask: ``[batch, seq]`` True (or 1) on answer tokens.

    Returns:
        ``(sums, lengths)``: ``[batch]`` summed log-probs in nats (the dtype of ``token_logps``) and ``[batch]`` answer
        tokens (int64).

    Raises:
        ValueError: not 2-D, the shapes differ, ``token_logps`` not floating point, or the mask not bool / 0-1.

    >>> sums, lengths = sequence_logps(torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[0, 1, 1]]))
    >>> sums.tolist(), lengths.tolist()
    ([-5.0], [2])
    """
    if token_logps.dim() != 2 or not token_logps.is_floating_point():
        raise ValueError(f"token_logps: expected a float tensor [batch, seq], got {token_logps.dtype} "
                         f"{tuple(token_logps.shape)}")
    if completion_mask.shape != token_logps.shape:
        raise ValueError(f"completion_mask: expected the shape of token_logps {tuple(token_logps.shape)}, got "
                         f"{tuple(completion_mask.shape)}")
    mask = _as_bool(completion_mask, "completion_mask")
    sums = torch.where(mask, token_logps, torch.zeros((), dtype=token_logps.dtype, device=token_logps.device))
    return sums.sum(dim=-1), mask.sum(dim=-1)


def preference_loss(objective: str, policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
                    ref_chosen_logps: Optional[torch.Tensor] = None, ref_rejected_logps: Optional[torch.Tensor] = None,
                    *, beta: float, chosen_lengths: Optional[torch.Tensor] = None,
                    rejected_lengths: Optional[torch.Tensor] = None, label_smoothing: float = 0.0,
                    gamma_beta_ratio: float = 0.5, rpo_alpha: float = 0.0) -> PreferenceLoss:
    """The loss of a paired objective (``dpo``, ``ipo``, ``simpo``, ``orpo``) on one batch of pairs (module docstring).

    Args:
        objective: ``dpo``, ``ipo``, ``simpo`` or ``orpo`` (KTO is unpaired: :func:`kto_loss`).
        policy_chosen_logps: ``[batch]`` the policy's summed log-probs of the chosen answers, nats.
        policy_rejected_logps: ``[batch]`` the same for the rejected answers.
        ref_chosen_logps: ``[batch]`` the reference model's, for ``dpo`` and ``ipo``; None for SimPO and ORPO.
        ref_rejected_logps: ``[batch]`` the same for the rejected answers.
        beta: DPO / IPO / SimPO's beta (IPO: the paper's tau; SimPO paper: 2.0-2.5); ORPO: the paper's lambda, the
            odds-ratio term's weight (TRL's ``ORPOConfig.beta``). Must be > 0.
        chosen_lengths: ``[batch]`` answer tokens of the chosen answers (:func:`sequence_logps`); needed by ``ipo``,
            ``simpo``, ``orpo`` and ``rpo_alpha > 0``; each >= 1.
        rejected_lengths: ``[batch]`` the same for the rejected answers; needed by ``ipo``, ``simpo``, ``orpo``.
        label_smoothing: ``e``, the assumed probability that a pair's label is flipped (conservative DPO), in
            ``[0, 0.5)``; ``dpo`` and ``simpo`` only.
        gamma_beta_ratio: SimPO's target margin over beta, ``gamma / beta`` (SimPO's own name; TRL's
            ``simpo_gamma = gamma_beta_ratio * beta``); nats per token.
        rpo_alpha: weight of the NLL term on the chosen answers (RPO) for ``dpo``, ``ipo``, ``simpo``; 0 = none.

    Returns:
        :class:`PreferenceLoss`.

    Raises:
        ValueError: an unknown ``objective`` or a bad value, naming the argument: a shape other than ``[batch]`` or
            batches that differ, reference log-probs missing (``dpo``, ``ipo``) or given (``simpo``, ``orpo``),
            lengths missing or < 1, ``beta <= 0``, ``label_smoothing`` outside ``[0, 0.5)`` or where unused,
            ``rpo_alpha < 0`` or with ``orpo``.
    """
    _check_objective(objective, PAIRED)
    if not beta > 0:
        raise ValueError(f"beta: must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing: must lie in [0, 0.5), got {label_smoothing}")
    if label_smoothing and objective not in ("dpo", "simpo"):
        raise ValueError(f"label_smoothing: only dpo and simpo use it, got {label_smoothing} with {objective}")
    if not rpo_alpha >= 0:
        raise ValueError(f"rpo_alpha: must be >= 0, got {rpo_alpha}")
    if rpo_alpha and objective == "orpo":
        raise ValueError(f"rpo_alpha: orpo carries its own NLL term (weight 1), got rpo_alpha={rpo_alpha}")
    batch = _batch_of(policy_chosen_logps, "policy_chosen_logps")
    dtype = _compute_dtype(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    pol_w = _vector(policy_chosen_logps, "policy_chosen_logps", batch, dtype)
    pol_l = _vector(policy_rejected_logps, "policy_rejected_logps", batch, dtype)
    if objective in REFERENCE_FREE:
        for name, value in (("ref_chosen_logps", ref_chosen_logps), ("ref_rejected_logps", ref_rejected_logps)):
            if value is not None:
                raise ValueError(f"{name}: {objective} is reference-free; pass None (skip the reference forward)")
    else:
        ref_w = _vector(_required(ref_chosen_logps, "ref_chosen_logps", objective), "ref_chosen_logps", batch,
                        dtype).detach()
        ref_l = _vector(_required(ref_rejected_logps, "ref_rejected_logps", objective), "ref_rejected_logps", batch,
                        dtype).detach()
    len_w = len_l = None
    if objective != "dpo" or rpo_alpha:
        len_w = _lengths(_required(chosen_lengths, "chosen_lengths", objective), "chosen_lengths", batch, dtype)
    if objective != "dpo":
        len_l = _lengths(_required(rejected_lengths, "rejected_lengths", objective), "rejected_lengths", batch, dtype)

    metrics: Dict[str, torch.Tensor] = {}
    if objective in ("dpo", "ipo"):
        reward_w, reward_l = pol_w - ref_w, pol_l - ref_l  # r = log pi - log ref, nats
        if objective == "dpo":
            losses = _smoothed_logistic(beta * (reward_w - reward_l), label_smoothing)
        else:  # per token (trl dpo_trainer.py "ipo"); 1 / (2 tau) is the paper's target margin
            losses = (reward_w / len_w - reward_l / len_l - 1 / (2 * beta)) ** 2
        logps_w, logps_l = pol_w, pol_l
    else:
        logps_w, logps_l = pol_w / len_w, pol_l / len_l  # a: mean log-prob per answer token, nats
        reward_w, reward_l = logps_w, logps_l
        if objective == "simpo":
            losses = _smoothed_logistic(beta * (logps_w - logps_l - gamma_beta_ratio), label_smoothing)
        else:  # log odds(y) = log p - log(1 - p) with p = exp(a); log1mexp keeps 1 - p exact near p = 1
            log_odds = (logps_w - logps_l) - (_log1mexp(logps_w) - _log1mexp(logps_l))
            log_sigmoid = F.logsigmoid(log_odds)
            losses = -beta * log_sigmoid
            metrics["log_odds_ratio"] = log_sigmoid.detach().mean()
            metrics["log_odds_chosen"] = log_odds.detach().mean()
    loss = losses.mean()
    nll_weight = 1.0 if objective == "orpo" else rpo_alpha
    if nll_weight:
        nll = -pol_w.sum() / len_w.sum()  # mean NLL per chosen answer token over the batch, nats
        loss = loss + nll_weight * nll
        metrics["nll_loss"] = nll.detach()
    metrics.update(_reward_metrics(beta * reward_w.detach(), beta * reward_l.detach(), logps_w.detach(),
                                   logps_l.detach()))
    return PreferenceLoss(loss=loss, losses=losses, metrics=metrics)


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor,
             policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor, *, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> PreferenceLoss:
    """KTO's loss on one batch of unpaired, labelled answers (module docstring; Ethayarajh et al. 2024).

    The reference point ``z`` is the batch's estimate of ``KL(pi || ref)``: the mean of ``policy_kl_logps -
    ref_kl_logps`` over answers paired with a prompt they do not belong to (TRL rotates the batch's completions by
    one, so a batch needs > 1 example), clamped at 0 and detached (no gradient through it). With several processes
    TRL averages the estimate over them before the clamp; pass the gathered KL log-probs for the same.

    Args:
        policy_logps: ``[batch]`` the policy's summed log-probs of each answer, nats.
        ref_logps: ``[batch]`` the reference model's.
        desirable: ``[batch]`` True (or 1) for a desirable answer, False (0) for an undesirable one.
        policy_kl_logps: ``[batch]`` the policy's summed log-probs of the mismatched answers, nats.
        ref_kl_logps: ``[batch]`` the reference model's for the same.
        beta: > 0 (TRL's default 0.1).
        desirable_weight: ``w_d`` (the paper's lambda_D), >= 0; the paper keeps ``w_d n_d / (w_u n_u)`` in [1, 4/3].
        undesirable_weight: ``w_u`` (lambda_U), >= 0.

    Returns:
        :class:`PreferenceLoss`; ``loss`` is the mean over the batch. ``rewards/chosen`` and ``logps/chosen`` are means
        over the desirable answers (absent when there are none), ``*/rejected`` over the undesirable ones,
        ``rewards/margins`` only with both (TRL logs no ``rewards/accuracies`` for KTO); ``kl`` is ``z``.

    Raises:
        ValueError: a shape other than ``[batch]`` or batches that differ, ``desirable`` not bool / 0-1, ``beta <= 0``
            or a negative weight, naming the argument.
    """
    if not beta > 0:
        raise ValueError(f"beta: must be > 0, got {beta}")
    for name, weight in (("desirable_weight", desirable_weight), ("undesirable_weight", undesirable_weight)):
        if not weight >= 0:
            raise ValueError(f"{name}: must be >= 0, got {weight}")
    batch = _batch_of(policy_logps, "policy_logps")
    dtype = _compute_dtype(policy_logps, ref_logps, policy_kl_logps, ref_kl_logps)
    policy = _vector(policy_logps, "policy_logps", batch, dtype)
    ref = _vector(ref_logps, "ref_logps", batch, dtype).detach()
    if desirable.shape != (batch,):
        raise ValueError(f"desirable: expected shape [batch] = ({batch},), got {tuple(desirable.shape)}")
    good = _as_bool(desirable, "desirable")
    kl_policy = _vector(policy_kl_logps, "policy_kl_logps", None, dtype)
    kl_ref = _vector(ref_kl_logps, "ref_kl_logps", kl_policy.shape[0], dtype)
    kl = (kl_policy - kl_ref).mean().clamp(min=0).detach()  # z: a baseline with no gradient
    reward = policy - ref
    losses = torch.where(good, desirable_weight * (1 - torch.sigmoid(beta * (reward - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - reward))))
    metrics: Dict[str, torch.Tensor] = {"kl": kl}
    rewards = beta * reward.detach()
    for side, rows in (("chosen", good), ("rejected", ~good)):
        if bool(rows.any()):
            metrics[f"rewards/{side}"] = rewards[rows].mean()
            metrics[f"logps/{side}"] = policy.detach()[rows].mean()
    if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return PreferenceLoss(loss=losses.mean(), losses=losses, metrics=metrics)


def _smoothed_logistic(logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """``-(1 - e) log sig(x) - e log sig(-x)`` ``[batch]``: the logistic loss with the label flipped at rate ``e``."""
    losses = -F.logsigmoid(logits)
    if label_smoothing:
        losses = (1 - label_smoothing) * losses - label_smoothing * F.logsigmoid(-logits)
    return losses


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate on both sides of ``-ln 2`` (Maechler 2012, "Accurately computing
    log(1 - exp(-|a|))": ``log1p(-exp(x))`` below, ``log(-expm1(x))`` above; trl orpo_trainer.py ``log1mexp``)."""
    return torch.where(x < -_LN2, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _reward_metrics(reward_w: torch.Tensor, reward_l: torch.Tensor, logps_w: torch.Tensor,
                    logps_l: torch.Tensor) -> Dict[str, torch.Tensor]:
    """TRL's paired metrics from ``[batch]`` rewards and log-probs (all detached): means over the batch; accuracy is
    the share of pairs whose chosen reward is strictly higher (a tie counts as wrong)."""
    return {"rewards/chosen": reward_w.mean(), "rewards/rejected": reward_l.mean(),
            "rewards/accuracies": (reward_w > reward_l).to(reward_w.dtype).mean(),
            "rewards/margins": (reward_w - reward_l).mean(), "logps/chosen": logps_w.mean(),
            "logps/rejected": logps_l.mean()}


def _check_objective(objective: str, allowed: Tuple[str, ...]) -> None:
    if objective not in allowed:
        hint = " (kto is unpaired: use kto_loss)" if objective == "kto" else ""
        raise ValueError(f"objective: expected one of {', '.join(allowed)}, got {objective!r}{hint}")


def _required(value: Optional[torch.Tensor], name: str, objective: str) -> torch.Tensor:
    if value is None:
        raise ValueError(f"{name}: {objective} needs it, got None")
    return value


def _batch_of(value: torch.Tensor, name: str) -> int:
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.shape[0] < 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{name}: expected a tensor of shape [batch] with batch >= 1, got {shape}")
    return value.shape[0]


def _vector(value: torch.Tensor, name: str, batch: Optional[int], dtype: torch.dtype) -> torch.Tensor:
    """``value`` checked to be a float ``[batch]`` tensor (any batch >= 1 when ``batch`` is None), as ``dtype``."""
    size = _batch_of(value, name)
    if batch is not None and size != batch:
        raise ValueError(f"{name}: expected shape [batch] = ({batch},), got {tuple(value.shape)}")
    if not value.is_floating_point():
        raise ValueError(f"{name}: expected floating-point log-probs, got {value.dtype}")
    return value.to(dtype)


def _compute_dtype(*values: Optional[torch.Tensor]) -> torch.dtype:
    """float32, or wider where a floating-point input is (float64 stays float64; bf16 / fp16 sums are widened)."""
    dtype = torch.float32
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            dtype = torch.promote_types(dtype, value.dtype)
    return dtype


def _lengths(value: torch.Tensor, name: str, batch: int, dtype: torch.dtype) -> torch.Tensor:
    """Answer lengths checked (``[batch]``, each >= 1 token) and returned as ``dtype``."""
    size = _batch_of(value, name)
    if size != batch:
        raise ValueError(f"{name}: expected shape [batch] = ({batch},), got {tuple(value.shape)}")
    if bool((value < 1).any()):
        first = int(torch.nonzero(value < 1)[0, 0])
        raise ValueError(f"{name}: every answer needs at least one token, got {value[first].item()} at pair {first}")
    return value.detach().to(dtype)


def _as_bool(mask: torch.Tensor, name: str) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or mask.is_complex() or bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{name}: expected bool or 0 / 1 values, got {mask.dtype}")
    return mask.bool()
