"""The bring-up loop: verify -> localize -> classify -> remedy -> re-verify, then buy the speed back.

`run_bringup` (loop.py) drives it; failure signatures (signatures.py) are computed from verify's
evidence; remedies (remedies/, one file each) turn a signature into override rules for an emulated
chip (targets/overrides.py); the playbook (playbook.py) remembers which remedy fixed which
signature on which chip and model family, and the planner (planner.py) ranks remedies by it.
"""
