"""Without a KL term (algorithm.kl_coef 0, verl's use_kl_loss false) no reference copy is loaded and
no reference forward pass runs, as in verl (issue 40); the trained step is unchanged, and a
checkpoint without a reference cannot be resumed by a run with a KL term. In-process, tiny
reasoner."""

from tiny_trainer import make_trainer

import prorl.policy as policy_module
from prorl.config import load_config, to_dict
from prorl.config_runtime import resume_conflicts
from prorl.update import Updater

BASE = ["trainer.prompts_per_step=2", "rollout.n=4", "reward.length_penalty=false",
        "trainer.mini_batches=1", "algorithm.dynamic_sampling=false", "trainer.deterministic=true",
        "rollout.max_response_tokens=16"]  # fmt: skip


def test_no_reference_is_loaded_or_run_without_kl(tiny_setup, monkeypatch):
    loads, passes = [], []
    real_load, real_pass = policy_module.load_hf, Updater.response_logprobs
    monkeypatch.setattr(
        policy_module, "load_hf", lambda *a, **k: loads.append(a) or real_load(*a, **k)
    )

    def counted_pass(self, model, *args, **kw):
        passes.append(model)
        return real_pass(self, model, *args, **kw)

    monkeypatch.setattr(Updater, "response_logprobs", counted_pass)
    runs = {}
    for kl in ("0", "1e-3"):
        loads.clear(), passes.clear()
        trainer = make_trainer(tiny_setup, [*BASE, f"algorithm.kl_coef={kl}"])
        m = trainer.step()
        runs[kl] = (len(loads), trainer.reference, [p is trainer.reference for p in passes], m)
    loaded, reference, ref_passes, m = runs["0"]
    assert reference is None and loaded == 1 and not any(ref_passes)
    assert m["actor/kl_mean"] == 0.0 and m["dynamic_sampling/kept_groups"] == 2
    loaded, reference, ref_passes, _ = runs["1e-3"]
    assert reference is not None and loaded == 2 and sum(ref_passes) == 1


def test_a_kl_term_cannot_resume_a_run_saved_without_one():
    saved = load_config("default", ["algorithm.kl_coef=0"])

    bad, _ = resume_conflicts(to_dict(saved), load_config("default", ["algorithm.kl_coef=1e-3"]))
    assert bad == ["algorithm.kl_coef"]
    bad, _ = resume_conflicts(to_dict(load_config("default", ["algorithm.kl_coef=1e-3"])), saved)
    assert bad == []  # the saved reference is simply not read
