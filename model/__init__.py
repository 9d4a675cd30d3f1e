"""A small Llama 3.x inference engine in PyTorch.

    from model import load_checkpoint, generate
    ckpt = load_checkpoint("weights/Llama-3.2-1B-Instruct")
    ids = ckpt.chat_format.encode_dialog([{"role": "user", "content": "Hi!"}])
    for piece in generate(ckpt, ids, max_new_tokens=64, temperature=0.7, top_p=0.9):
        print(piece, end="", flush=True)

Names are imported on first use, so `from model.config import ...` does not import torch.
"""

import importlib

_EXPORTS = {
    "chat_format": ["ChatFormat", "TemplateChatFormat", "load_chat_format"],
    "checkpoint": ["Checkpoint", "load_checkpoint"],
    "checkpoint_files": ["CheckpointError", "find_checkpoint"],
    "config": ["ConfigError", "LlamaConfig", "RopeScaling"],
    "context": ["PromptTooLong"],
    "decoding": ["Decoding", "Logprob", "StopScanner", "TextStream"],
    "generation": ["Generation", "generate"],
    "kv_cache": ["KVCache"],
    "llama": ["Llama"],
    "sampling": ["Sampler", "SamplingParams", "sample", "token_logprobs"],
    "stats": ["Stats"],
    "tokenizer": ["HFTokenizer", "Tokenizer", "load_tokenizer"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
