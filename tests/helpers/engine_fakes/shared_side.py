"""Host-side fake of an engine process shared by several configurations (vLLM's `configure`): one
`posenc_side.Fake` at a time, rebuilt when the configuration changes; the linear rule is refused the way
vLLM refuses a configuration (an answer, not a crash). `configures()` counts the rebuilds."""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location("posenc_side", os.path.join(os.path.dirname(__file__), "posenc_side.py"))
posenc_side = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(posenc_side)


class Shared:
    def __init__(self):
        self.fake, self.config, self.count = None, None, 0

    def configure(self, config):
        if config == self.config:
            return {"refused": None}
        self.fake = self.config = None
        rule = config.get("rule")
        if rule and rule.get("rope_type") == "linear":
            return {"refused": "ValueError: User-specified max_model_len (4096) is greater than the derived (128)"}
        self.count += 1
        self.fake = posenc_side.Fake(config["model_path"], rule, config.get("fault"), config.get("chunk"))
        self.config = config
        return {"refused": None}

    def score(self, batch, top_k=1, positions=None):
        return self.fake.score(batch, top_k, positions)

    def generate(self, ids, n, positions=None):
        return self.fake.generate(ids, n, positions)

    def configures(self):
        return self.count


def load():
    return Shared()
