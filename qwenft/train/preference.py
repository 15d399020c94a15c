"""Preference training: :class:`PreferenceTrainer` (DPO, IPO, SimPO, ORPO, KTO on :mod:`qwenft.preference.loss`),
its collator, and the reference model without a second copy.

One step, for a batch of ``B`` pairs:

1. the collator lays out the ``2B`` sequences (prompt + chosen for every pair, then prompt + rejected;
   :class:`PreferenceCollator`) either right-padded ``[2B, seq]`` with an attention mask, or padding-free: one row
   ``[1, tokens]`` with ``position_ids`` restarting at 0 for each sequence, from which transformers 5 derives each
   sequence's own causal mask (sdpa, eager; flash-attention's varlen path); the padding-free loss equals the padded
   one (a test checks it);
2. one forward of the policy over all of them (:func:`sequence_logprobs`): the body gives the final hidden states,
   and only the answer tokens are projected onto the vocabulary, a chunk at a time, so no ``[tokens, vocab]`` logits
   tensor is held (:class:`_TokenLogprobs` recomputes a chunk's logits in backward instead of keeping them);
3. the reference's log-probs of the same sequences (objectives that have a reference: dpo, ipo, kto), computed
   under ``torch.no_grad`` by the same model with the adapter switched off (:func:`reference_adapter`): peft's
   ``disable_adapter`` (the reference is the base), or, for a run started from an SFT adapter (``init_adapter``),
   the frozen copy of that adapter loaded beside the trained one as ``reference`` and made active for the
   reference forward (the adapter weights are the only second copy); or read from the batch, where
   ``pref.precompute_ref`` computed them once before training (:func:`precompute_reference`);
4. the objective's loss and TRL's metrics (:func:`qwenft.preference.loss.preference_loss` /
   :func:`~qwenft.preference.loss.kto_loss`), the metrics averaged over the logging interval and logged under TRL's
   names (``rewards/chosen``, ..., ``eval_rewards/chosen`` for the held-out pairs).

KTO's batch is ``B`` prompt + answer sequences, then the same prompts with the answers rotated by one (answer
``i - 1`` after prompt ``i``: TRL's KL estimate's mismatched pairs), in one forward.

SFT rows mixed into a paired objective's run by weight (an SFT source with ``weight > 0``,
:mod:`qwenft.preference.pipeline`; KTO takes them as desirable examples instead) ride in the same batches: the
collator lays them out apart (``sft_*``, right-padded, :mod:`qwenft.train.pref_collator`), the policy runs one more
forward over them, and their NLL (nats per supervised token, as SFT's loss) joins the objective's loss with each row
weighted as a pair: ``loss = (P * objective + S * nll) / (P + S)`` for a batch of ``P`` pairs and ``S`` SFT rows,
logged as ``sft_nll``. No reference forward runs for them.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from typing import Any, Dict, List, Optional

import torch

from qwenft.config import Config, ConfigError
from qwenft.data.template import IGNORE_INDEX
from qwenft.kernels import chunk_tokens
from qwenft.train.pref_collator import PreferenceCollator, is_sft_row  # noqa: F401 - the trainer's collator
from qwenft.train.trainer import QwenftTrainer

log = logging.getLogger("qwenft.train")

REFERENCE_ADAPTER = "reference"  # the frozen copy of init_adapter, beside the trained "default"


class _TokenLogprobs(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T)[targets]`` per row, ``[rows]`` fp32, chunk by chunk.

    Backward recomputes each chunk's logits (one ``[chunk, vocab]`` buffer at a time) and applies the gradient of
    a target's log-prob with respect to the logits, ``onehot(t) - softmax(z)``, scaled by the incoming gradient of
    that row: nothing of size ``vocab`` is kept between forward and backward.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):  # noqa: D102 - documented on the class
        out = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)  # per row, for backward
        for start in range(0, hidden.shape[0], chunk):
            logits = (hidden[start:start + chunk] @ weight.t()).float()  # the one [chunk, vocab] fp32 buffer
            target = logits.gather(1, targets[start:start + chunk, None]).squeeze(1)
            peak = logits.amax(dim=-1)
            lse[start:start + chunk] = peak + logits.sub_(peak[:, None]).exp_().sum(dim=-1).log()  # in place
            out[start:start + chunk] = target - lse[start:start + chunk]
            del logits
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102 - documented on the class
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            h, t = hidden[start:start + ctx.chunk], targets[start:start + ctx.chunk]
            probs = (h @ weight.t()).float().sub_(lse[start:start + ctx.chunk, None]).exp_()  # softmax, in place
            probs.neg_()
            probs[torch.arange(t.shape[0], device=t.device), t] += 1.0  # onehot - softmax
            probs.mul_(grad_out[start:start + ctx.chunk, None].float())
            grad_logits = probs.to(hidden.dtype)  # the same buffer when hidden is fp32
            del probs
            if need_hidden:
                grad_hidden[start:start + ctx.chunk] = grad_logits @ weight
            if need_weight:
                grad_weight += grad_logits.t().float() @ h.float()
        return grad_hidden, (grad_weight.to(weight.dtype) if need_weight else None), None, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   chunk: Optional[int] = None) -> torch.Tensor:
    """Log-probabilities (nats) of ``targets`` under ``hidden @ weight.T``, differentiable, without a logits tensor.

    Under a 16-bit autocast region the projection runs in the autocast dtype (as ``F.linear`` would there), the
    log-softmax in fp32.

    Args:
        hidden: ``[rows, hidden]`` final hidden states at the positions predicting ``targets``.
        weight: ``[vocab, hidden]`` ``lm_head.weight``.
        targets: ``[rows]`` int64 ids.
        chunk: rows per chunk (default :func:`qwenft.kernels.chunk_tokens` of the vocabulary).

    Returns:
        ``[rows]`` fp32 log-probs (<= 0).

    Raises:
        ValueError: mismatched shapes.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or \
            targets.shape != hidden.shape[:1]:
        raise ValueError(f"token_logprobs: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, targets "
                         f"{tuple(targets.shape)}: expected [rows, hidden], [vocab, hidden], [rows]")
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    with torch.autocast(device_type, enabled=False):
        return _TokenLogprobs.apply(hidden.to(dtype), weight.to(dtype), targets, chunk or chunk_tokens(weight.shape[0]))


def sequence_logprobs(model, batch: Dict[str, torch.Tensor]):
    """Summed answer log-probs of every sequence of a collated batch (:class:`PreferenceCollator`), one forward.

    Args:
        model: a ``Qwen2ForCausalLM`` or a ``PeftModel`` around one.
        batch: ``input_ids`` and ``labels`` (``[rows, seq]``, -100 off the answers), with ``attention_mask``
            (padded) or ``position_ids`` (padding-free); ``seq_ids`` ``[rows, seq]``: the sequence each token
            belongs to (-1 for padding); ``n_seqs``: how many sequences.

    Returns:
        ``(logps, lengths)``: ``[n_seqs]`` fp32 sums of the answer tokens' log-probs (nats) and ``[n_seqs]`` int64
        answer lengths (tokens).
    """
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    features = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    hidden = causal.model(**features, use_cache=False).last_hidden_state
    targets = batch["labels"][:, 1:]
    keep = targets != IGNORE_INDEX
    token_lp = token_logprobs(hidden[:, :-1][keep], causal.lm_head.weight, targets[keep])
    owner = batch["seq_ids"][:, 1:][keep]
    n = int(batch["n_seqs"])
    sums = torch.zeros(n, dtype=torch.float32, device=token_lp.device).index_add(0, owner, token_lp)
    lengths = torch.zeros(n, dtype=torch.int64, device=token_lp.device).index_add(0, owner, torch.ones_like(owner))
    return sums, lengths


def padding_free_of(config: Config) -> bool:
    """``pref.padding_free`` resolved (:func:`qwenft.config.train.padding_free`: ``auto`` is padding-free on
    flash_attention_2 only; sdpa and eager would hold a ``[tokens, tokens]`` mask over the whole batch)."""
    from qwenft.config.train import padding_free

    return padding_free(config.train.objective, config.pref.padding_free, config.model.attn_implementation)


@contextlib.contextmanager
def reference_adapter(model):
    """The reference model for the body of the ``with``: the frozen ``reference`` adapter made active when the
    model holds one (a run from ``init_adapter``), else every adapter disabled (the base). LoRA dropout is off
    (eval mode) meanwhile; the trained adapter is active again afterwards, the reference copy frozen."""
    training = model.training
    model.eval()
    try:
        if REFERENCE_ADAPTER in getattr(model, "peft_config", {}):
            active = model.active_adapter
            model.set_adapter(REFERENCE_ADAPTER)
            try:
                yield model
            finally:
                model.set_adapter(active)  # peft: the active adapter trainable, the others frozen
        elif hasattr(model, "disable_adapter"):
            with model.disable_adapter():
                yield model
        else:
            raise ConfigError("the reference model needs a LoRA adapter to switch off; the model holds none")
    finally:
        model.train(training)


class PreferenceTrainer(QwenftTrainer):
    """:class:`~qwenft.train.trainer.QwenftTrainer` with a preference objective's loss (module docstring).

    Attributes set by :func:`make_preference_trainer`: ``pref`` (the ``pref`` section), ``objective``.
    """

    def __init__(self, *args: Any, objective: str, pref, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.objective, self.pref = objective, pref
        # the loss is a mean over the batch's pairs: the Trainer divides it by the accumulation steps (as TRL's)
        self.model_accepts_loss_kwargs = False
        self.eval_loss_is_nll = False
        self._stored: Dict[str, Dict[str, List[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}

    def reference_logprobs(self, model, inputs) -> torch.Tensor:
        """``[n_seqs]`` the reference's summed answer log-probs of the batch (no gradient)."""
        with torch.no_grad(), reference_adapter(model), self.accelerator.autocast():
            logps, _ = sequence_logprobs(model, inputs)
        return logps.detach()

    def preference_outputs(self, model, inputs):
        """The batch's :class:`~qwenft.preference.loss.PreferenceLoss` (policy forward, reference, objective)."""
        from qwenft.preference.loss import kto_loss, needs_reference, preference_loss

        b = int(inputs["pairs"])
        ref = None
        if needs_reference(self.objective):  # before the policy's forward: its peak never adds to the policy graph's
            if "ref_chosen_logps" in inputs:
                ref = torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]])
            else:
                ref = self.reference_logprobs(model, inputs)
        with self.accelerator.autocast():
            logps, lengths = sequence_logprobs(model, inputs)
        if ref is not None:
            ref = ref.to(logps.device)
        p = self.pref
        if self.objective == "kto":
            return kto_loss(logps[:b], ref[:b], inputs["label"], logps[b:], ref[b:], beta=p.beta,
                            desirable_weight=p.desirable_weight, undesirable_weight=p.undesirable_weight)
        return preference_loss(self.objective, logps[:b], logps[b:], None if ref is None else ref[:b],
                               None if ref is None else ref[b:], beta=p.beta, chosen_lengths=lengths[:b],
                               rejected_lengths=lengths[b:], label_smoothing=p.label_smoothing,
                               gamma_beta_ratio=p.gamma_beta_ratio, rpo_alpha=p.rpo_alpha)

    def sft_nll(self, model, inputs) -> torch.Tensor:
        """The batch's SFT rows' NLL: nats per supervised token (their summed token NLL over their token count), as
        SFT's loss (:func:`qwenft.train.loss.supervised_loss_sum`, no logits tensor)."""
        from qwenft.train.loss import supervised_loss_sum

        rows = {"input_ids": inputs["sft_input_ids"], "attention_mask": inputs["sft_attention_mask"],
                "labels": inputs["sft_labels"]}
        with self.accelerator.autocast():
            total, count = supervised_loss_sum(model, rows, self.kernels)
        return total / count.clamp(min=1)

    def batch_tokens(self, inputs) -> int:
        """The non-padding tokens of the batch's preference sequences and SFT rows."""
        tokens = 0
        if int(inputs["pairs"]):
            tokens += super().batch_tokens(inputs)
        if int(inputs["sft_rows"]):
            tokens += int(inputs["sft_attention_mask"].sum())
        return tokens

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The objective's loss on one batch, with the SFT rows' NLL mixed in (module docstring); the metrics are
        kept for the next log (``train`` or ``eval``)."""
        store = self._stored["train" if model.training else "eval"]
        pairs, rows = int(inputs["pairs"]), int(inputs.get("sft_rows", 0))
        loss = None
        if pairs:
            out = self.preference_outputs(model, inputs)
            for name, value in out.metrics.items():
                store[name].append(float(value))
            loss = out.loss
        if rows:
            nll = self.sft_nll(model, inputs)
            store["sft_nll"].append(float(nll.detach()))
            loss = nll if loss is None else (pairs * loss + rows * nll) / (pairs + rows)
        return (loss, {"loss": loss}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The eval loss of a held-out batch (its metrics kept for the eval log); no logits are returned."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        """Add the stored metrics' means since the last log, TRL's names (``eval_`` before each for an eval log)."""
        phase = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        prefix = "eval_" if phase == "eval" else ""
        for name, values in self._stored[phase].items():
            if values:
                logs[prefix + name] = round(sum(values) / len(values), 6)
        self._stored[phase].clear()
        super().log(logs, start_time)


def precompute_reference(model, dataset, collator: PreferenceCollator, batch_size: int, autocast):
    """``dataset`` (pairs) with ``ref_chosen_logps`` / ``ref_rejected_logps`` columns: the reference's summed
    answer log-probs (nats), computed once, ``batch_size`` pairs at a time, without gradients.

    Args:
        autocast: a context manager factory for the forward's precision (the Trainer's ``accelerator.autocast``).
    """
    from tqdm.auto import tqdm

    chosen: List[float] = []
    rejected: List[float] = []
    device = next(model.parameters()).device
    with tqdm(total=len(dataset), desc="reference log-probs", unit="row", leave=False) as bar:
        for start in range(0, len(dataset), batch_size):
            rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
            pairs = [k for k, row in enumerate(rows) if not is_sft_row(row)]
            got_chosen, got_rejected = [0.0] * len(rows), [0.0] * len(rows)  # an SFT row has no reference: 0
            if pairs:
                batch = {k: v.to(device) for k, v in collator([rows[k] for k in pairs]).items()}
                with torch.no_grad(), reference_adapter(model), autocast():
                    logps, _ = sequence_logprobs(model, batch)
                b = len(pairs)
                for k, c, r in zip(pairs, logps[:b].tolist(), logps[b:].tolist()):
                    got_chosen[k], got_rejected[k] = c, r
            chosen += got_chosen
            rejected += got_rejected
            bar.update(len(rows))
    return dataset.add_column("ref_chosen_logps", chosen).add_column("ref_rejected_logps", rejected)


def make_preference_trainer(config: Config, model, tokenizer, bundle, checkpoint_dir, kernels: str):
    """The preference run's Trainer: :func:`qwenft.train.trainer.make_trainer`'s arguments and callbacks, the
    :class:`PreferenceCollator`, and the reference log-probs precomputed when ``pref.precompute_ref``.

    Raises:
        ConfigError: ``pref.precompute_ref`` with ``train.objective=kto`` (its mismatched pairs depend on the batch).
    """
    from qwenft.preference.loss import needs_reference
    from qwenft.train.trainer import make_trainer

    unpaired = config.train.objective == "kto"
    collator = PreferenceCollator(tokenizer.pad_token_id, padding_free_of(config), unpaired)
    trainer = make_trainer(config, model, tokenizer, bundle, checkpoint_dir, kernels, collator=collator,
                           trainer_class=PreferenceTrainer,
                           trainer_kwargs={"objective": config.train.objective, "pref": config.pref})
    if config.pref.precompute_ref and needs_reference(config.train.objective):
        if unpaired:
            raise ConfigError("pref.precompute_ref=true with train.objective=kto: KTO's KL estimate pairs each "
                              "prompt with another example's answer in the same batch, so its reference log-probs "
                              "cannot be computed before the batches are drawn; set pref.precompute_ref=false")
        trainer.train_dataset = precompute_reference(model, trainer.train_dataset, collator,
                                                     config.train.batch_size, trainer.accelerator.autocast)
        if trainer.eval_dataset is not None:
            trainer.eval_dataset = precompute_reference(model, trainer.eval_dataset, collator,
                                                        config.train.batch_size, trainer.accelerator.autocast)
    return trainer
