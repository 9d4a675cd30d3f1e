"""A small Llama 3.x inference engine in PyTorch.

    from model import load_checkpoint, generate
    ckpt = load_checkpoint("weights/Llama-3.2-1B-Instruct")
    ids = ckpt.chat_format.encode_dialog([{"role": "user", "content": "Hi!"}])
    for piece in generate(ckpt, ids, max_new_tokens=64, temperature=0.7, top_p=0.9):
        print(piece, end="", flush=True)
"""

from .chat_format import ChatFormat, TemplateChatFormat, load_chat_format
from .checkpoint import Checkpoint, CheckpointError, find_checkpoint, load_checkpoint
from .config import ConfigError, LlamaConfig, RopeScaling
from .generate import Generation, GenerationStats, PromptTooLong, TextStream, generate
from .kv_cache import KVCache
from .llama import Llama
from .sampling import sample
from .tokenizer import HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ChatFormat", "Checkpoint", "CheckpointError", "ConfigError", "Generation", "GenerationStats",
    "HFTokenizer", "KVCache", "Llama", "LlamaConfig", "PromptTooLong", "RopeScaling",
    "TemplateChatFormat", "TextStream", "Tokenizer", "find_checkpoint", "generate",
    "load_chat_format", "load_checkpoint", "load_tokenizer", "sample",
]
