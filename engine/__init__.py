"""prorl.engine: the RL-agnostic training engine (model, attention, parallelism, optimizer,
checkpoint, rollout, metrics). Imports `prorl.kernels` only; never the trainer in `prorl`."""

if __name__ == "engine":  # found by its folder name from the repository root: not our name
    # kernels/_toplevel.py loaded by its path: importing prorl.kernels here would load torch (and
    # let inspect cache this file as the module `engine`) before the name is handed over
    import importlib.util as _util
    import os as _os

    _path = _os.path.join(_os.path.dirname(_os.path.dirname(__file__)), "kernels", "_toplevel.py")
    _spec = _util.spec_from_file_location("_prorl_toplevel", _path)
    _toplevel = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_toplevel)
    _toplevel.hand_over(__name__, __file__)
