"""The preference losses (qwenft.preference.loss) against TRL 1.16's own code on the same model and batch, and their
invariants (ln 2 at the reference, gradients only to the policy, errors naming the argument).

TRL is the reference, not a run-time dependency (the ``test`` extra pins trl==1.16.0); the comparisons skip without
it. TRL's losses live inside trainer methods, so each comparison calls the method unbound on a stand-in that carries
only the attributes that method reads (built below, one per trainer); nothing else of a trainer is built. The model
both sides score is :class:`_BigramLM`, a causal LM whose logits at a position depend on that position's token only
(a float64 ``[vocab, vocab]`` table): TRL runs its own forward, masking, summing and length normalisation on it;
qwenft's side goes through :func:`sequence_logps`.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from qwenft.preference.loss import kto_loss, needs_reference, preference_loss, sequence_logps

TOL = 1e-6  # nats; the bar (TRL's ORPO computes in float32, the rest here runs in float64)
VOCAB, PAD = 13, 0
PAIRED_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                  "logps/rejected")
MAX_DIFF: dict = defaultdict(float)  # objective -> the largest |qwenft - TRL| seen (read when reporting)


@pytest.fixture(scope="module")
def trl():
    """TRL 1.16's trainer modules; the comparison tests skip, with the reason, where trl is not installed."""
    module = pytest.importorskip("trl", reason="trl==1.16.0 (the test extra) is the reference for the losses")
    if tuple(int(part) for part in module.__version__.split(".")[:2]) != (1, 16):
        pytest.skip(f"the stand-ins follow trl 1.16's trainer code; installed: trl {module.__version__}")
    with warnings.catch_warnings():  # TRLExperimentalWarning: the CPO / ORPO trainers live in trl.experimental
        warnings.simplefilter("ignore")
        from trl.experimental.cpo.cpo_trainer import CPOTrainer
        from trl.experimental.orpo.orpo_trainer import ORPOTrainer
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.kto_trainer import KTOTrainer
    return SimpleNamespace(DPOTrainer=DPOTrainer, KTOTrainer=KTOTrainer, CPOTrainer=CPOTrainer, ORPOTrainer=ORPOTrainer)


class _BigramLM(torch.nn.Module):
    """The smallest causal LM. ``fused_lm_head=True`` answers as trl's ``add_fused_lm_head`` forward does: the
    log-probs of the next tokens whose label is not -100, 0 elsewhere, ``[batch, seq - 1]`` (entropy, mean logits and
    top-1 as zeros: TRL only logs them); otherwise ``logits`` ``[batch, seq, vocab]``."""

    is_gradient_checkpointing = False  # read by trl's disable_gradient_checkpointing

    def __init__(self, seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.table = torch.nn.Parameter(2 * torch.randn(VOCAB, VOCAB, generator=generator, dtype=torch.float64))
        self.eval()  # TRL logs under "eval" and skips its token count

    def forward(self, input_ids, attention_mask=None, labels=None, fused_lm_head=False, **_):
        logits = self.table[input_ids]
        if not fused_lm_head:
            return SimpleNamespace(logits=logits)
        targets = labels[:, 1:]
        logps = logits[:, :-1].log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        logps = logps.masked_fill(targets == -100, 0.0)
        zeros = torch.zeros_like(logps)
        return SimpleNamespace(log_probs=logps, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    def token_logps(self, input_ids):
        """``[batch, seq - 1]`` log p(input_ids[:, t + 1] | input_ids[:, :t + 1]), every position (qwenft's side)."""
        return self.table[input_ids[:, :-1]].log_softmax(-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


class _Accelerator:
    """One process on the CPU: gathers are the identity."""

    device = torch.device("cpu")

    @staticmethod
    def gather(tensor):
        return tensor

    gather_for_metrics = gather


def _rows(prompts, completions):
    """Right-padded ``input_ids``, ``attention_mask``, ``completion_mask`` ``[rows, seq]`` of prompt + completion."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    attention, completion = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (prompt, answer) in enumerate(zip(prompts, completions)):
        ids[i, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        attention[i, :len(prompt) + len(answer)] = 1
        completion[i, len(prompt):len(prompt) + len(answer)] = 1
    return ids, attention, completion


def _random_texts(generator, count, low, high):
    lengths = torch.randint(low, high + 1, (count,), generator=generator).tolist()
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def _pairs(batch: int, seed: int):
    """``batch`` pairs as TRL's DPO collator lays them out: ``[chosen; rejected]`` rows sharing their prompts."""
    generator = torch.Generator().manual_seed(seed)
    prompts = _random_texts(generator, batch, 1, 4)
    chosen, rejected = _random_texts(generator, batch, 1, 6), _random_texts(generator, batch, 1, 6)
    return _rows(prompts + prompts, chosen + rejected)


def _ours(model, ids, completion):
    """qwenft's per-sequence sums and lengths: :func:`sequence_logps` over the model's token log-probs."""
    return sequence_logps(model.token_logps(ids), completion[:, 1:])


def _check(objective, ours, theirs):
    """``|ours - theirs| <= TOL``, the difference kept in MAX_DIFF."""
    ours, theirs = (torch.as_tensor(value, dtype=torch.float64).detach() for value in (ours, theirs))  # floats too
    diff = (ours - theirs).abs().max()
    MAX_DIFF[objective] = max(MAX_DIFF[objective], float(diff))
    assert float(diff) <= TOL, f"{objective}: |qwenft - trl| = {float(diff):.3g}"


def _dpo_stand_in(policy, reference, loss_types, loss_weights, beta):
    """What ``DPOTrainer._compute_loss`` reads of ``self``, and nothing more (reference forward by TRL itself)."""
    return SimpleNamespace(model=policy, ref_model=reference, accelerator=_Accelerator(), args=SimpleNamespace(
        gradient_checkpointing_kwargs=None), aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=False,
        f_divergence_type="reverse_kl", loss_types=loss_types, loss_weights=loss_weights, beta=beta,
        label_smoothing=0.0, use_weighting=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1)


def _trl_dpo(trl, policy, reference, ids, attention, completion, loss_types, loss_weights, beta):
    stand_in = _dpo_stand_in(policy, reference, loss_types, loss_weights, beta)
    inputs = {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}
    loss = trl.DPOTrainer._compute_loss(stand_in, policy, inputs, return_outputs=False)
    return loss, {name: values[-1] for name, values in stand_in._metrics["eval"].items()}


def _paired(objective, policy, reference, ids, completion, **kwargs):
    sums, lengths = _ours(policy, ids, completion)
    (pol_w, pol_l), (len_w, len_l) = sums.chunk(2), lengths.chunk(2)
    ref_w = ref_l = None
    if needs_reference(objective):
        with torch.no_grad():
            ref_w, ref_l = _ours(reference, ids, completion)[0].chunk(2)
    return preference_loss(objective, pol_w, pol_l, ref_w, ref_l, chosen_lengths=len_w, rejected_lengths=len_l,
                           **kwargs)


@pytest.mark.parametrize("batch, beta, loss_types, rpo_alpha", [
    (1, 0.1, ["sigmoid"], 0.0), (4, 0.1, ["sigmoid"], 0.0), (8, 0.5, ["sigmoid"], 0.0), (3, 2.0, ["sigmoid"], 0.0),
    (1, 0.1, ["ipo"], 0.0), (5, 0.1, ["ipo"], 0.0), (8, 0.5, ["ipo"], 0.0),
    (4, 0.1, ["sigmoid", "sft"], 1.0), (6, 0.3, ["sigmoid", "sft"], 0.25), (5, 0.1, ["ipo", "sft"], 0.5)])
def test_dpo_ipo_and_rpo_equal_trls_dpo_trainer(trl, batch, beta, loss_types, rpo_alpha):
    """``DPOTrainer._compute_loss`` (``sigmoid``, ``ipo``; RPO as ``[loss, "sft"]`` weighted ``[1, alpha]``): the
    loss and every reward / log-prob metric, TRL running both forwards on the same two models."""
    policy, reference = _BigramLM(seed=batch), _BigramLM(seed=100 + batch)
    ids, attention, completion = _pairs(batch, seed=batch)
    objective = "dpo" if loss_types[0] == "sigmoid" else "ipo"
    weights = [1.0, rpo_alpha] if rpo_alpha else [1.0]
    trl_loss, trl_metrics = _trl_dpo(trl, policy, reference, ids, attention, completion, loss_types, weights, beta)
    ours = _paired(objective, policy, reference, ids, completion, beta=beta, rpo_alpha=rpo_alpha)
    _check(objective if not rpo_alpha else f"{objective}+rpo", ours.loss, trl_loss)
    for name in PAIRED_METRICS:
        _check(objective, ours.metrics[name], trl_metrics[name])


@pytest.mark.parametrize("batch, beta, label_smoothing", [(1, 0.1, 0.1), (4, 0.1, 0.1), (8, 0.5, 0.3),
                                                          (5, 0.2, 0.0)])
def test_conservative_dpo_equals_trls_smoothed_logistic_loss(trl, batch, beta, label_smoothing):
    """TRL 1.16's DPO ``sigmoid`` dropped label smoothing; the conservative form lives on in ``CPOTrainer.cpo_loss``
    (``sigmoid``), which applied to the log ratios ``log pi - log ref`` is cDPO. The sums come from TRL's
    ``get_batch_logps`` on the two models' logits; the per-pair losses and rewards are compared."""
    policy, reference = _BigramLM(seed=batch), _BigramLM(seed=100 + batch)
    ids, _, completion = _pairs(batch, seed=10 + batch)
    labels = ids.masked_fill(completion == 0, -100)
    with torch.no_grad():
        pol_w, pol_l = trl.CPOTrainer.get_batch_logps(policy(ids).logits, labels).chunk(2)
        ref_w, ref_l = trl.CPOTrainer.get_batch_logps(reference(ids).logits, labels).chunk(2)
    stand_in = SimpleNamespace(alpha=0.0, loss_type="sigmoid", beta=beta, label_smoothing=label_smoothing,
                               accelerator=_Accelerator())
    losses, rewards_w, rewards_l = trl.CPOTrainer.cpo_loss(stand_in, pol_w - ref_w, pol_l - ref_l)
    ours = _paired("dpo", policy, reference, ids, completion, beta=beta, label_smoothing=label_smoothing)
    _check("dpo", ours.losses, losses)
    _check("dpo", ours.loss, losses.mean())
    _check("dpo", ours.metrics["rewards/chosen"], rewards_w.mean())
    _check("dpo", ours.metrics["rewards/margins"], (rewards_w - rewards_l).mean())


def _cpo_batch(ids, attention, completion):
    """The chosen_* / rejected_* batch TRL's CPO and ORPO trainers take (labels -100 outside the answers)."""
    labels = ids.masked_fill(completion == 0, -100)
    batch = {}
    for side, rows in (("chosen", slice(0, ids.shape[0] // 2)), ("rejected", slice(ids.shape[0] // 2, None))):
        batch.update({f"{side}_input_ids": ids[rows], f"{side}_attention_mask": attention[rows],
                      f"{side}_labels": labels[rows]})
    return batch


@pytest.mark.parametrize("batch, beta, gamma_beta_ratio, label_smoothing, rpo_alpha", [
    (1, 2.0, 0.5, 0.0, 0.0), (4, 2.0, 0.5, 0.0, 0.0), (8, 2.5, 0.55, 0.0, 0.0), (5, 0.5, 1.0, 0.2, 0.0),
    (6, 2.0, 0.5, 0.0, 1.0)])
def test_simpo_equals_trls_cpo_trainer(trl, batch, beta, gamma_beta_ratio, label_smoothing, rpo_alpha):
    """``CPOTrainer.get_batch_loss_metrics`` with ``loss_type="simpo"`` (TRL's own forward, masking and per-token
    means; ``simpo_gamma = gamma_beta_ratio * beta``; ``cpo_alpha`` = RPO's NLL weight on the chosen answers)."""
    policy = _BigramLM(seed=batch)
    ids, attention, completion = _pairs(batch, seed=20 + batch)
    stand_in = SimpleNamespace(alpha=0.0, loss_type="simpo", beta=beta, simpo_gamma=gamma_beta_ratio * beta,
                               label_smoothing=label_smoothing, cpo_alpha=rpo_alpha, is_encoder_decoder=False,
                               pad_token_id=PAD, aux_loss_enabled=False, accelerator=_Accelerator(),
                               concatenated_inputs=trl.CPOTrainer.concatenated_inputs,  # static methods
                               get_batch_logps=trl.CPOTrainer.get_batch_logps)
    stand_in.cpo_loss = trl.CPOTrainer.cpo_loss.__get__(stand_in)
    stand_in.concatenated_forward = trl.CPOTrainer.concatenated_forward.__get__(stand_in)
    trl_loss, trl_metrics = trl.CPOTrainer.get_batch_loss_metrics(stand_in, policy, _cpo_batch(ids, attention,
                                                                                               completion))
    ours = _paired("simpo", policy, None, ids, completion, beta=beta, gamma_beta_ratio=gamma_beta_ratio,
                   label_smoothing=label_smoothing, rpo_alpha=rpo_alpha)
    _check("simpo", ours.loss, trl_loss)
    for name in PAIRED_METRICS + (("nll_loss",) if rpo_alpha else ()):
        _check("simpo", ours.metrics[name], trl_metrics[name])


@pytest.mark.parametrize("batch, beta, dtype", [(1, 0.1, torch.float64), (4, 0.1, torch.float64),
                                                (8, 0.25, torch.float64), (6, 1.0, torch.float32)])
def test_orpo_equals_trls_orpo_trainer(trl, batch, beta, dtype):
    """``ORPOTrainer.get_batch_loss_metrics`` and ``odds_ratio_loss`` (TRL's forward and per-token means; its odds
    ratio in float32). TRL's NLL term also counts the prompt tokens and qwenft's does not, so the losses are compared
    without it; qwenft's NLL (answer tokens) is checked against CPO's, which has that scope."""
    policy = _BigramLM(seed=batch).to(dtype)
    ids, attention, completion = _pairs(batch, seed=30 + batch)
    stand_in = SimpleNamespace(beta=beta, is_encoder_decoder=False, padding_value=PAD, aux_loss_enabled=False,
                               accelerator=_Accelerator(), concatenated_inputs=trl.ORPOTrainer.concatenated_inputs,
                               get_batch_logps=trl.ORPOTrainer.get_batch_logps)
    stand_in.odds_ratio_loss = trl.ORPOTrainer.odds_ratio_loss.__get__(stand_in)
    stand_in.concatenated_forward = trl.ORPOTrainer.concatenated_forward.__get__(stand_in)
    batch_inputs = _cpo_batch(ids, attention, completion)
    trl_loss, trl_metrics = trl.ORPOTrainer.get_batch_loss_metrics(stand_in, policy, batch_inputs)
    avg_w, avg_l = stand_in.concatenated_forward(policy, batch_inputs)[:2]
    trl_losses = trl.ORPOTrainer.odds_ratio_loss(stand_in, avg_w, avg_l)[0]
    ours = _paired("orpo", policy, None, ids, completion, beta=beta)
    _check("orpo", ours.losses, -trl_losses)
    _check("orpo", ours.loss - ours.metrics["nll_loss"], trl_loss - trl_metrics["nll_loss"])
    for name in PAIRED_METRICS + ("log_odds_ratio", "log_odds_chosen"):
        _check("orpo", ours.metrics[name], trl_metrics[name])
    labels = ids.masked_fill(completion == 0, -100)
    answer_nll = torch.nn.functional.cross_entropy(policy(ids).logits[:batch, :-1].flatten(0, 1),
                                                   labels[:batch, 1:].flatten())  # CPO's NLL: answer tokens only
    _check("orpo", ours.metrics["nll_loss"], answer_nll)


def _kto_batch(batch: int, seed: int):
    """KTO rows and TRL's KL rows: each prompt with the completion before it in the batch (rotated by one)."""
    generator = torch.Generator().manual_seed(seed)
    prompts, answers = _random_texts(generator, batch, 1, 4), _random_texts(generator, batch, 1, 6)
    desirable = torch.rand(batch, generator=generator) < 0.6
    desirable[0], desirable[-1] = True, False  # both kinds in every batch (a batch has >= 2 rows)
    ids, attention, completion = _rows(prompts, answers)
    kl_ids, kl_attention, kl_completion = _rows(prompts, answers[-1:] + answers[:-1])
    return dict(input_ids=ids, attention_mask=attention, completion_mask=completion, label=desirable,
                KL_input_ids=kl_ids, KL_attention_mask=kl_attention, KL_completion_mask=kl_completion)


@pytest.mark.parametrize("batch, beta, weights, all_desirable", [
    (2, 0.1, (1.0, 1.0), False), (5, 0.1, (1.0, 1.0), False), (8, 0.5, (1.0, 1.33), False),
    (6, 0.2, (0.8, 1.0), False), (4, 0.1, (1.0, 1.0), True)])
def test_kto_equals_trls_kto_trainer(trl, batch, beta, weights, all_desirable):
    """``KTOTrainer._compute_loss`` (``kto``; its KL rows, KL forwards and reference forwards run by TRL)."""
    policy, reference = _BigramLM(seed=batch), _BigramLM(seed=200 + batch)
    inputs = _kto_batch(batch, seed=40 + batch)
    if all_desirable:
        inputs["label"] = torch.ones(batch, dtype=torch.bool)
    stand_in = SimpleNamespace(model=policy, ref_model=reference, accelerator=_Accelerator(), args=SimpleNamespace(
        gradient_checkpointing_kwargs=None), aux_loss_enabled=False, precompute_ref_logps=False, calculate_KL=True,
        loss_type="kto", beta=beta, desirable_weight=weights[0], undesirable_weight=weights[1],
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    stand_in._compute_kl_logps = trl.KTOTrainer._compute_kl_logps.__get__(stand_in)
    trl_loss = trl.KTOTrainer._compute_loss(stand_in, policy, inputs, return_outputs=False)
    trl_metrics = {name: values[-1] for name, values in stand_in._metrics["eval"].items()}
    logps, _ = _ours(policy, inputs["input_ids"], inputs["completion_mask"])
    kl_logps, _ = _ours(policy, inputs["KL_input_ids"], inputs["KL_completion_mask"])
    with torch.no_grad():
        ref_logps, _ = _ours(reference, inputs["input_ids"], inputs["completion_mask"])
        ref_kl_logps, _ = _ours(reference, inputs["KL_input_ids"], inputs["KL_completion_mask"])
    ours = kto_loss(logps, ref_logps, inputs["label"], kl_logps, ref_kl_logps, beta=beta,
                    desirable_weight=weights[0], undesirable_weight=weights[1])
    _check("kto", ours.loss, trl_loss)
    expected = {"kl", "rewards/chosen", "logps/chosen"} | (set() if all_desirable else {
        "rewards/rejected", "logps/rejected", "rewards/margins"})
    assert set(ours.metrics) == expected
    for name in expected:
        _check("kto", ours.metrics[name], trl_metrics[name])


def test_dpo_is_ln2_with_the_metrics_0_when_the_policy_is_the_reference():
    """At the start of DPO (policy == reference) the loss is ln 2 = 0.6931 and every reward metric 0 (trl #1962: a
    loss stuck there after steps means the reference log-probs are the policy's)."""
    generator = torch.Generator().manual_seed(0)
    logps_w, logps_l = -20 * torch.rand(6, generator=generator), -20 * torch.rand(6, generator=generator)
    for smoothing in (0.0, 0.1):
        result = preference_loss("dpo", logps_w, logps_l, logps_w.clone(), logps_l.clone(), beta=0.1,
                                 label_smoothing=smoothing)
        assert result.loss.item() == pytest.approx(math.log(2), abs=1e-7)
        assert torch.allclose(result.losses, torch.full((6,), math.log(2)))
        for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
            assert result.metrics[name].item() == 0.0, name
        assert result.metrics["logps/chosen"].item() == pytest.approx(logps_w.mean().item())


@pytest.mark.parametrize("objective", ["dpo", "ipo", "simpo", "orpo", "kto"])
def test_gradients_reach_only_the_policy(objective):
    generator = torch.Generator().manual_seed(1)
    tensors = [(-1 - 10 * torch.rand(4, generator=generator, dtype=torch.float64)).requires_grad_() for _ in range(6)]
    pol_w, pol_l, ref_w, ref_l, kl_pol, kl_ref = tensors
    lengths = torch.tensor([3, 5, 2, 7])
    if objective == "kto":
        desirable = torch.tensor([True, False, True, False])
        kto_loss(pol_w, ref_w, desirable, kl_pol, kl_ref, beta=0.1).loss.backward()
        policy, frozen = [pol_w], [ref_w, kl_pol, kl_ref]  # z, the KL estimate, is detached too
    else:
        refs = (ref_w, ref_l) if needs_reference(objective) else (None, None)
        preference_loss(objective, pol_w, pol_l, *refs, beta=0.1, chosen_lengths=lengths, rejected_lengths=lengths,
                        rpo_alpha=0.5 if objective != "orpo" else 0.0).loss.backward()
        policy, frozen = [pol_w, pol_l], [ref_w, ref_l]
    for tensor in policy:
        assert tensor.grad is not None and bool((tensor.grad != 0).all())
    assert all(tensor.grad is None for tensor in frozen)


def test_reference_free_objectives_need_no_reference_and_dpo_does():
    pol_w, pol_l, lengths = torch.tensor([-4.0, -9.0]), torch.tensor([-6.0, -3.0]), torch.tensor([2, 3])
    assert not needs_reference("simpo") and not needs_reference("orpo")
    assert needs_reference("dpo") and needs_reference("ipo") and needs_reference("kto")
    for objective in ("simpo", "orpo"):
        result = preference_loss(objective, pol_w, pol_l, beta=0.1, chosen_lengths=lengths, rejected_lengths=lengths)
        assert torch.isfinite(result.loss)
        with pytest.raises(ValueError, match="ref_chosen_logps: .*reference-free"):
            preference_loss(objective, pol_w, pol_l, pol_w, pol_l, beta=0.1, chosen_lengths=lengths,
                            rejected_lengths=lengths)
    with pytest.raises(ValueError, match="ref_chosen_logps: dpo needs it"):
        preference_loss("dpo", pol_w, pol_l, beta=0.1)
    with pytest.raises(ValueError, match="ref_rejected_logps: ipo needs it"):
        preference_loss("ipo", pol_w, pol_l, pol_w, None, beta=0.1, chosen_lengths=lengths, rejected_lengths=lengths)


def test_sequence_logps_counts_only_the_answer_tokens():
    """Prompt and padding positions hold anything (-inf, NaN, large values) and count for nothing, gradient
    included; a 0 / 1 integer mask works as a bool one."""
    token_logps = torch.tensor([[-50.0, -1.0, -2.0, float("nan")], [float("-inf"), -0.5, -0.25, -1e4]],
                               requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0]])
    sums, lengths = sequence_logps(token_logps, mask)
    assert sums.tolist() == [-3.0, -0.75] and lengths.tolist() == [2, 2] and lengths.dtype == torch.long
    sums.sum().backward()
    assert token_logps.grad.tolist() == [[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]]
    assert sequence_logps(token_logps.detach(), mask.bool())[0].tolist() == [-3.0, -0.75]


@pytest.mark.parametrize("call, match", [
    (lambda v, n: preference_loss("sft", v, v, v, v, beta=0.1), "objective: expected one of dpo, ipo, simpo, orpo"),
    (lambda v, n: preference_loss("kto", v, v, v, v, beta=0.1), "objective: .*use kto_loss"),
    (lambda v, n: needs_reference("rlhf"), "objective: expected one of"),
    (lambda v, n: preference_loss("dpo", v[None], v[None], v[None], v[None], beta=0.1),
     r"policy_chosen_logps: expected a tensor of shape \[batch\]"),
    (lambda v, n: preference_loss("dpo", v, v[:2], v, v, beta=0.1), r"policy_rejected_logps: .*\(3,\), got \(2,\)"),
    (lambda v, n: preference_loss("dpo", v, v, v, v[:1], beta=0.1), "ref_rejected_logps: expected shape"),
    (lambda v, n: preference_loss("dpo", v, v, v, v, beta=0.0), "beta: must be > 0"),
    (lambda v, n: preference_loss("dpo", v, v, v, v, beta=0.1, label_smoothing=0.5), "label_smoothing: .*0.5"),
    (lambda v, n: preference_loss("ipo", v, v, v, v, beta=0.1, chosen_lengths=n, rejected_lengths=n,
                                  label_smoothing=0.1), "label_smoothing: only dpo and simpo"),
    (lambda v, n: preference_loss("simpo", v, v, beta=2.0, chosen_lengths=n), "rejected_lengths: simpo needs it"),
    (lambda v, n: preference_loss("simpo", v, v, beta=2.0, chosen_lengths=n, rejected_lengths=n * 0),
     "rejected_lengths: every answer needs at least one token, got 0 at pair 0"),
    (lambda v, n: preference_loss("dpo", v, v, v, v, beta=0.1, rpo_alpha=1.0), "chosen_lengths: dpo needs it"),
    (lambda v, n: preference_loss("orpo", v, v, beta=0.1, chosen_lengths=n, rejected_lengths=n, rpo_alpha=1.0),
     "rpo_alpha: orpo carries its own NLL term"),
    (lambda v, n: preference_loss("dpo", n, n, n, n, beta=0.1), "policy_chosen_logps: expected floating-point"),
    (lambda v, n: kto_loss(v, v, torch.tensor([0.5, 1.0, 0.0]), v, v, beta=0.1), "desirable: expected bool"),
    (lambda v, n: kto_loss(v, v, torch.ones(2, dtype=torch.bool), v, v, beta=0.1), r"desirable: .*\(3,\)"),
    (lambda v, n: kto_loss(v, v, n > 0, v, v, beta=0.1, undesirable_weight=-1.0), "undesirable_weight: must be"),
    (lambda v, n: sequence_logps(v[None], n[None, :2]), "completion_mask: expected the shape of token_logps"),
    (lambda v, n: sequence_logps(v[None], n[None] + 1), "completion_mask: expected bool or 0 / 1"),
])
def test_bad_input_is_a_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.tensor([-3.0, -4.0, -5.0]), torch.tensor([1, 2, 3]))
