"""Files sent with a message: read into text at the edge (read.py), cut into chunks and ranked against the
question (chunks.py) where a file does not fit the prompt whole. No torch, no web framework: the web
process, the API and the engine all use it."""
