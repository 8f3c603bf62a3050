"""Groups placed all or nothing: what a plan is (`plan`), planning a whole group (`groups`), packed groups (`packed`),
GPU-less members (`beside`), members held by their own selectors (`assigned`), JobSet exclusive placement (`exclusive`),
re-planning around placed members (`replan`), tensor-parallel groups across nodes (`tpgroups`, `rack`), tier sets
(`tiersets`), ComputeDomains (`imex`) and the index of nodes by label that answers members' nodeSelectors
(`labelindex`). May import the node, network and state layers.
"""
