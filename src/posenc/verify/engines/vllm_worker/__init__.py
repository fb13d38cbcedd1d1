"""Modules that vLLM's worker processes import by name (this folder is put on their `PYTHONPATH`).

vLLM pickles the function given to `LLM.apply_model` by reference, so it must live in a module the
worker can import; this folder holds only such modules, so nothing in it shadows a real package.
"""
