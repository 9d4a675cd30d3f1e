"""Tools that bring a model into `weights/`. The engine imports them only to prepare the embedded default
model on its first start (prepare_default.py); loading a model never does.

    python -m model.fetch <owner/name>          download a Hugging Face checkpoint (hub.py)
    python -m model.fetch <file.gguf | folder>  import llama.cpp / Ollama / LM Studio files (gguf.py)
    python -m model.prepare_default             the embedded default model (prepare_default.py)

Each writes one folder that the engine loads with `model.load_checkpoint`, built beside its final
place and renamed into it when complete (folder.py).
"""
