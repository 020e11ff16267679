"""`edgeq optimize`: the fastest verified model, by a ladder of the stages that exist (PTQ, plan, QAT).

Candidates are chosen on the val split and the chosen one is confirmed once on test, which no choice
saw (``ladder``); the folder it writes is one a user can ship (``record``).
"""
