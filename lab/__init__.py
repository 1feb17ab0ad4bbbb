"""The real-engine lab: a local model and a real vLLM server (:mod:`kvscope.lab.engine`),
the closed-loop sweep (:mod:`kvscope.lab.sweep`), recordings of real runs
(:mod:`kvscope.lab.recording`), the demo (:mod:`kvscope.lab.demo`) and large generated
fleets (:mod:`kvscope.lab.fleetgen`).
"""
