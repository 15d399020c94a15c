"""Preference tuning (issue 45): pairs of chosen / rejected answers (and KTO's unpaired, labelled answers) read from
the formats people have, and the objectives that learn from them (DPO, IPO, SimPO, ORPO, KTO, the RPO NLL term).

A lower room: :mod:`qwenft.train` and :mod:`qwenft.evaluate` build on it; it imports only the rooms below it
(data, chat, config)."""
