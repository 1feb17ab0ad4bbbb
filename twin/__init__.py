"""The engine twin: vLLM's own scheduler replaying traffic on a simulated clock.

vLLM's v1 scheduler and KV-cache manager (admission, block allocation, prefix hits,
preemption, chunked prefill, the token budget, ``max_num_seqs``) run for real, in this
process, without a model; a step-time model (:mod:`kvscope.twin.steptime`) stands in
for the forward pass. What the scheduler reports goes through the real plugin into a
collector (:mod:`kvscope.twin.feed`), so the advisor, the dashboard, the report and
/metrics see a twin as they see a server, labelled as simulated.

Modules: :mod:`~kvscope.twin.shape` (the engine configuration and vLLM's config
objects), :mod:`~kvscope.twin.steptime`, :mod:`~kvscope.twin.streams` (traces, Poisson
arrivals, closed-loop clients), :mod:`~kvscope.twin.sim` (the loop) and
:mod:`~kvscope.twin.feed`. Needs the ``twin`` extra (vLLM; the CPU build is enough).
"""
