"""The chat template checks: present, ChatML as Qwen2.5 writes it, and the family's default system prompt.

A template is judged by what it renders, as transformers renders it (jinja2's sandbox with ``trim_blocks`` and
``lstrip_blocks``, ``raise_exception`` and ``tojson``: transformers/utils/chat_template_utils.py), on two
conversations: a user turn alone (the default system prompt must appear) and a system + user + assistant exchange
(every turn ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``). A template whose sha256 is Qwen2.5's own
(:data:`qwenft.chat.QWEN_TEMPLATE_SHA256`) is named as such.
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional

from qwenft.chat import IM_END, IM_START, PLAIN_SYSTEM_PROMPT, QWEN_SYSTEM_PROMPT, QWEN_TEMPLATE_SHA256
from qwenft.doctor.findings import Report

USER_ONLY = [{"role": "user", "content": "Hi"}]
EXCHANGE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}]


def turn(role: str, content: str) -> str:
    """One ChatML turn as Qwen2.5 writes it."""
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def render(template: str, messages, add_generation_prompt: bool) -> str:
    """``template`` rendered as ``apply_chat_template(..., tokenize=False)`` would.

    Raises:
        jinja2.TemplateError: the template does not parse or raises.
    """
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None, **kw: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            tools=None, bos_token="", eos_token=IM_END)


def default_system(template: str) -> Optional[str]:
    """The system prompt ``template`` adds to a conversation without one; None when it adds none (or fails)."""
    try:
        text = render(template, USER_ONLY, True)
    except Exception:  # noqa: BLE001 -- jinja2 raises many kinds; the ChatML check reports a broken template
        return None
    head = f"{IM_START}system\n"
    if not text.startswith(head) or IM_END not in text:
        return None
    return text[len(head):text.index(IM_END)]


def is_chatml(template: Optional[str]) -> bool:
    """Whether ``template`` renders :data:`EXCHANGE` as Qwen2.5's ChatML turns."""
    if not template:
        return False
    try:
        text = render(template, EXCHANGE, False)
    except Exception:  # noqa: BLE001
        return False
    return text == "".join(turn(m["role"], m["content"]) for m in EXCHANGE)


def ends_turns_with_im_end(template: Optional[str]) -> bool:
    """Whether the template closes an assistant turn with ``<|im_end|>`` (so generation must stop on it)."""
    if not template:
        return False
    try:
        return f"Hello.{IM_END}" in render(template, EXCHANGE, False)
    except Exception:  # noqa: BLE001
        return IM_END in template


def check_template(report: Report, template: Optional[str], where: str, qwen2: bool, family: Optional[object],
                   instruct: Optional[bool], missing_fix: Optional[str] = None) -> None:
    """The template findings for the template of ``where`` (a file name, or the GGUF key).

    Args:
        template: its text; None when there is none.
        qwen2: the model is a Qwen2 (ChatML expected).
        family: the family member it is (None: not a member; the system prompt is then not checked).
        instruct: an Instruct model (True), a base model (False) or unknown (None).
        missing_fix: the fix for ``template-missing`` (a GGUF's differs); None: a model directory's.
    """
    if not qwen2:
        return
    if not template:
        report.add("template-missing", f"no chat template ({where})", missing_fix or (
                   "save the tokenizer of the model you trained from (tokenizer.save_pretrained) or copy its "
                   "chat_template; llama.cpp's converter writes tokenizer.chat_template from tokenizer_config.json"))
        return
    digest = hashlib.sha256(template.encode("utf-8")).hexdigest()
    if digest in QWEN_TEMPLATE_SHA256:
        report.note(f"chat template ({where}): Qwen2.5's Instruct template, unchanged")
        return
    if not is_chatml(template):
        report.add("template-not-chatml", f"the chat template ({where}) does not render Qwen2.5's ChatML turns "
                   "(<|im_start|>ROLE\\nCONTENT<|im_end|>\\n)", "use the chat template of the Qwen2.5 model you "
                   "trained from: the model was trained on ChatML and answers other formats badly")
        return
    system = default_system(template)
    if family is None:
        report.note(f"chat template ({where}): ChatML, default system prompt {system!r}")
        return
    line = getattr(family, "line", "")
    expected = [QWEN_SYSTEM_PROMPT] if instruct and line != "Qwen2.5-Math" else [QWEN_SYSTEM_PROMPT,
                                                                                   PLAIN_SYSTEM_PROMPT]
    if line == "Qwen2.5-Math" and system is not None:
        expected.append(system)  # Math's own default (step-by-step reasoning) is not kept here
    if system not in expected:
        said = "adds no system turn" if system is None else f"adds {system!r}"
        report.add("template-system-prompt", f"with no system message the chat template ({where}) {said}; "
                   f"the family's default is {QWEN_SYSTEM_PROMPT!r}",
                   "restore the default system turn of the Qwen2.5 template (the model was tuned and evaluated "
                   "with it), or pass your system prompt on every request")
        return
    report.note(f"chat template ({where}): ChatML with the family's default system prompt (not byte-identical "
                "to Qwen2.5's; renders the same for plain chat)")
