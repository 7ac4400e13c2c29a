"""Evaluation of the engine: the bench (decode.evaluation.bench), its cost model, goals, reports and run
comparison, and the quality of lossy outputs. The engine (decode/*.py) imports nothing from here."""
