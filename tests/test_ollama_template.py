"""Ollama's per-request generate ``template`` (api/ollama_template.py): the Go template subset
read, Ollama's cut at ``.Response``, Go's whitespace trims, and what is refused."""

from __future__ import annotations

import pytest

from kvstream.api.ollama_template import TemplateUnsupported, render_generate_template

CHATML = ("{{ if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
          "<|im_start|>user\n{{ .Prompt }}<|im_end|>\n<|im_start|>assistant\n{{ .Response }}<|im_end|>\n")


def test_fields_and_conditions_render_and_the_text_after_response_is_cut():
    # Ollama cuts the turn being answered where .Response stands: the end-of-turn marker
    # after it follows the answer, it does not precede it.
    assert render_generate_template(CHATML, "Be brief.", "hi") == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert render_generate_template(CHATML, "", "hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render_generate_template("{{ .Prompt }}", "ignored", "as it is") == "as it is"
    assert render_generate_template("{{/* a comment */}}{{ .Prompt }}", "", "x") == "x"
    # .Response inside a branch cuts there too; tested, it is empty (the answer is not written yet)
    branch = "{{ if .System }}S:{{ .Response }}never{{ end }}after"
    assert render_generate_template(branch, "s", "p") == "S:" and render_generate_template(branch, "", "p") == "after"
    assert render_generate_template("{{ if .Response }}r{{ else }}none{{ end }}", "", "") == "none"


def test_else_branches_and_gos_whitespace_trims():
    template = "{{ if .System }}S:{{ .System }}{{ else if .Prompt }}P{{ else }}none{{ end }}"
    assert [render_generate_template(template, s, p) for s, p in [("a", "b"), ("", "b"), ("", "")]] == ["S:a", "P", "none"]
    # "{{- " trims the whitespace before the action, " -}}" the whitespace after it.
    assert render_generate_template("[INST]  \n {{- .Prompt -}} \n [/INST]", "", "hi") == "[INST]hi[/INST]"
    assert render_generate_template("a {{ if .System -}}  \n b {{- end }} c", "s", "") == "a b c"


@pytest.mark.parametrize("template, says", [
    ("{{ range .Messages }}{{ .Content }}{{ end }}", "{{ range .Messages }}"),
    ("{{ .Tools }}", "{{ .Tools }}"),
    ("{{ json .Prompt }}", "{{ json .Prompt }}"),
    ("{{ if .System }}open", "without its 'end'"),
    ("{{ end }}", "{{ end }}"),
    ("{{ .Prompt }} {{ .Suffix", "unclosed"),
    ("{{ if .Messages }}x{{ end }}", "{{ if .Messages }}"),
])
def test_what_is_not_read_is_refused_naming_it(template, says):
    with pytest.raises(TemplateUnsupported) as caught:
        render_generate_template(template, "", "hi")
    assert says in str(caught.value)
