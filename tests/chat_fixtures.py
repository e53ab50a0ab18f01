"""Chat fixtures made in the tests (no downloads): a tiny word-level tokenizer with Llama-3-style special tokens,
its tokenizer_config.json with a Llama-3-style chat template, and random chats over its words."""
import json

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
WORDS = ("system user assistant the a cat dog sat on mat why how what is it blue red sky sea fish runs jumps "
         "quickly slowly answer question please tell me about you are helpful model yes no maybe").split()
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def write_tokenizer(folder, template=LLAMA3_TEMPLATE, extra_words=0):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS + [f"w{k}" for k in range(extra_words)])}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(SPECIALS)
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                             special_tokens=[("<|begin_of_text|>", bos)])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}, "chat_template": template}))
    return str(folder / "tokenizer.json")


def sentence(rng):
    return " ".join(rng.choice(WORDS[3:], rng.integers(1, 12)))


def chat(rng):
    turns = [{"role": "system", "content": sentence(rng)}] if rng.random() < 0.5 else []
    for _ in range(rng.integers(1, 4)):
        turns += [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": sentence(rng)}]
    return turns
