"""The command lines of relaympi's packages, one module each, with the ``main`` that a package's
``__main__`` runs: topology (`python -m relaympi.topology`) and data (`python -m relaympi.data`).

A command sits above the layers it uses (a topology's description names the algorithms it suits;
``data check`` asks the tasks what a complete copy is), so it lives here rather than in the
package it drives, which stays in its own layer. The trainer's command is relaympi/train.py.
"""
