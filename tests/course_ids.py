"""The assignment ids a test needs when it runs a whole component (nanovllm/course).

A test carries every assignment its code path reaches, so that in a whole-course student
edition it is graded only once all of them are filled in (one unfinished stub must not cost
another assignment's points). `python -m nanovllm.course.audit` checks these lists.
"""

# A forward pass of the model without a KV cache (what tests/test_models.py runs).
MODEL = ("01.rmsnorm", "01.rope", "02.causal_attention")
# The scheduler over a real block manager, driven by a stand-in model (schedule, then
# update_from_output): its block accounting, admission, running loop and placeholders.
SCHEDULER = (
    "04.cached_prefix",
    "04.allocate",
    "04.free",
    "06.admit",
    "06.preempt",
    "11.placeholders",
)
# One engine step on CPU: the torch attention backend over the paged cache, the scheduler
# (every step runs its admission, its running loop and its placeholder protocol), the runner's
# packing of the step and the sampler (greedy steps too).
ENGINE = MODEL + (
    "01.sampler",
    "02.paged_attention",
    "03.store_kv",
    "03.decode_attention",
    *SCHEDULER,
    "04.prepare",
)
# The engine for its first step only (a prefill: no decode attention runs yet).
FIRST_STEP = tuple(a for a in ENGINE if a != "03.decode_attention")
