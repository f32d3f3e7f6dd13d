"""A relay's commit for the tests: each commit's tensors recorded, the version counted."""


class Recorder:
    def __init__(self):
        self.commits = []  # each commit's {name: tensor}, in order

    def __call__(self, named: list) -> int:
        self.commits.append(dict(named))
        return len(self.commits)
