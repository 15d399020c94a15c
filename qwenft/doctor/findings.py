"""What ``qwenft doctor`` reports: findings with stable codes, info lines, and the exit code they give.

A finding is something wrong with the artifact (``error``: it will behave wrongly, silently; ``warning``: it may, or
a tool will refuse it); an info line says what the artifact is or which checks were skipped and why. Exit codes:
0 clean (info lines only), 1 one finding or more, 2 unreadable (raised as :class:`qwenft.config.QwenftError`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

# code -> (severity, what it means): the stable list; docs/doctor.md's table lists exactly these (tests/doctor)
CODES: Dict[str, Tuple[str, str]] = {
    "eos-missing-im-end": ("error", "the chat template ends turns with <|im_end|> but the generation stops do not "
                                    "include it: generation never stops at the end of the answer"),
    "generation-config-missing": ("warning", "no generation_config.json: the stop list and sampling defaults fall "
                                             "back to config.json and the library's defaults"),
    "pad-is-im-end": ("warning", "the pad token is <|im_end|>, the token that ends a turn: masking padding by id "
                                 "masks the end of every answer, and the tuned model never stops"),
    "template-missing": ("error", "no chat template: servers fall back to another format"),
    "template-not-chatml": ("error", "the chat template does not write Qwen2.5's ChatML turns"),
    "template-system-prompt": ("warning", "the chat template's default system prompt is not the family's"),
    "tied-lm-head-differs": ("error", "tie_word_embeddings is true but a different lm_head.weight is saved: loading "
                                      "ties them and the trained output layer is lost"),
    "lm-head-missing": ("error", "tie_word_embeddings is false and no lm_head.weight is saved: the output layer is "
                                 "randomly initialised on load"),
    "adapter-lm-head-on-tied-base": ("warning", "the adapter trains lm_head or embed_tokens of a base whose "
                                                "embeddings are tied"),
    "quantization-config-leftover": ("error", "config.json names a quantization_config but the weights are 16-bit"),
    "embedding-rows-shrunk": ("error", "fewer embedding rows than the family member's vocabulary"),
    "tokens-beyond-rows": ("error", "the tokenizer has tokens beyond the embedding rows"),
    "rope-scaling-inconsistent": ("error", "RoPE scaling settings that contradict each other"),
    "adapter-base-mismatch": ("error", "the adapter's LoRA matrices do not fit the base's projections (trained on "
                                       "another model size)"),
    "adapter-targets-mismatch": ("error", "the adapter holds LoRA weights of modules its target_modules does not "
                                 "name: peft drops them silently"),
    "adapter-rank-mismatch": ("error", "the LoRA matrices' rank is not adapter_config.json's r"),
    "rope-theta-lost": ("error", "transformers loads another RoPE base (rope_theta) than config.json declares or "
                                 "the family member has"),
    "rope-trained-past-window": ("warning", "trained on sequences longer than the model's context, without enough "
                                            "RoPE scaling"),
    "rope-gguf-mismatch": ("error", "the GGUF's RoPE scaling differs from config.json's"),
    "vllm-lora-unsupported": ("warning", "vLLM cannot serve this adapter unmerged"),
    "gguf-special-token-type": ("error", "a Qwen special token in the GGUF is missing or not of type CONTROL"),
    "gguf-special-token-id": ("error", "a Qwen special token in the GGUF has another id than the family's"),
    "gguf-eos-not-end": ("error", "the GGUF's EOS / EOT id is not an end-of-turn token of its template"),
}


@dataclass
class Finding:
    """One problem: ``code`` (a key of :data:`CODES`), its ``severity``, what was found and what to do."""

    code: str
    severity: str
    message: str
    fix: str
    file: Optional[str] = None  # the file it is about, when PATH holds several artifacts (a GGUF in a model dir)

    def line(self) -> str:
        return f"{self.severity} {self.code}: {self.message}; fix: {self.fix}"


@dataclass
class Report:
    """Everything ``qwenft doctor`` says about one artifact: ``kind`` is ``adapter``, ``model`` or ``gguf``."""

    path: str
    kind: str
    info: List[str] = field(default_factory=list)
    findings: List[Finding] = field(default_factory=list)

    def add(self, code: str, message: str, fix: str) -> None:
        """Record a finding of ``code`` (its severity from :data:`CODES`).

        Raises:
            KeyError: an unknown code.
        """
        self.findings.append(Finding(code, CODES[code][0], message, fix))

    def note(self, text: str) -> None:
        """An info line: what the artifact is, or which checks were skipped and why."""
        self.info.append(text)

    def extend(self, other: "Report", label: str, file: Optional[str] = "") -> None:
        """Take ``other``'s findings, their messages prefixed with ``label`` and their ``file`` set to ``file``
        (by default the label: a GGUF's file name)."""
        for finding in other.findings:
            if not finding.message.startswith(f"{label}: "):
                finding.message = f"{label}: {finding.message}"
            finding.file = label if file == "" else file
            self.findings.append(finding)

    def codes(self) -> List[str]:
        return [f.code for f in self.findings]

    @property
    def exit_code(self) -> int:
        """0 clean, 1 findings."""
        return 1 if self.findings else 0

    def as_dict(self) -> dict:
        return {"path": self.path, "kind": self.kind, "exit_code": self.exit_code, "info": list(self.info),
                "findings": [asdict(f) for f in self.findings]}

    def text(self) -> str:
        """The printed report: a header, one line per info and finding, and a summary."""
        lines = [f"doctor: {self.path} ({KIND_NAMES[self.kind]})"]
        lines += [f"info: {text}" for text in self.info]
        lines += [f.line() for f in self.findings]
        if not self.findings:
            lines.append("doctor: clean (no findings)")
        else:
            errors = sum(f.severity == "error" for f in self.findings)
            lines.append(f"doctor: {len(self.findings)} finding(s): {errors} error(s), "
                         f"{len(self.findings) - errors} warning(s)")
        return "\n".join(lines)


KIND_NAMES = {"adapter": "LoRA adapter directory", "model": "model directory", "gguf": "GGUF file"}
