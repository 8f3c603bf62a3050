"""kube-scheduler's verbs over the ledger: the one door into them (`door`), the decisions (`service`), bind (`binder`),
the prioritize-ahead memory (`ahead`), the pods filter just saw (`recentpods`), gang members' filter (`gangs`), whose
hold a refused pod meets (`holdnotes`), lifting gputopo's scheduling gate for whole groups (`groupgates`), JobSet
exclusive placement (`exclusive`) and the Events that explain what happened (`events`). May import `watch`, `state` and
the wire types.
"""
