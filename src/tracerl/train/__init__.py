"""Training: the run's configuration, advantage estimators, the update, SFT and the loop.

Dependencies: ``train`` may import every part of tracerl except ``tracerl.testing``. Of
``eval`` it calls only the evaluation library: the scores and summaries of attempts
(``eval.summary``, ``eval.behaviour``) at held-out steps and ``eval.report`` for the demo's
report. ``eval`` imports nothing of ``train`` (it reads what a run wrote to disk), so the two
depend one way.

Demonstrations: ``sft`` trains on any demonstrations, rendered as the collector renders
attempts; the scripted demonstrator of the built-in suite is recipe and lives beside the
suite (``tracerl.envs.suite.demonstrator``); ``demos`` binds it to a run's ``sft`` config.
"""
