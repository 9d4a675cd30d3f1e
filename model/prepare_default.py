"""`python -m model.prepare_default`: the default model into weights/ (see model/convert/prepare_default.py)."""

from .convert.prepare_default import ConversionError, main, prepare_default

__all__ = ["ConversionError", "main", "prepare_default"]

if __name__ == "__main__":
    main()
