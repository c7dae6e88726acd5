"""Chat templates render with the model's own special tokens."""

from __future__ import annotations

import specjax
from specjax._src.models.chat import encode_chat, render_chat
from specjax._src.models.lm import Model

# Mistral-7B-Instruct-v0.2's template: every assistant turn ends with the EOS token.
MISTRAL_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
                    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}"
                    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}")


def test_a_template_that_ends_turns_with_eos_gets_the_models_eos_token():
    base = specjax.load("embedded-target")
    model = Model(base.params, base.module, base.tokenizer, chat_template=MISTRAL_TEMPLATE)
    eos_id = base.module.config.eos_token_id
    eos = base.tokenizer.id_to_token(eos_id)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "bye"}]
    assert render_chat(model, messages) == f"[INST] hi [/INST]hello{eos}[INST] bye [/INST]"
    assert encode_chat(model, messages).count(eos_id) == 1  # one whole special token, not its spelling
    bare = Model(base.params, base.module, None, chat_template=MISTRAL_TEMPLATE)
    assert render_chat(bare, messages) == "[INST] hi [/INST]hello[INST] bye [/INST]"  # no tokenizer: no text for it
