"""Host-side fake: reports whether posenc's engines folder is importable as top-level modules."""

import importlib.util


class Probe:
    def where(self):
        spec = importlib.util.find_spec("process")  # posenc/verify/engines/process.py if the folder leaked
        return None if spec is None else spec.origin


def load():
    return Probe()
