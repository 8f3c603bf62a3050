"""What the extender learns from the API server: the one seam to it (`source`), the informers' side of the cache
(`cache`), what is registered per watched kind (`handlers`), API objects read into records (`parsers`), a Job's state
(`jobstate`), the controller objects inference reads (`controllerfacts`), the DRA merge (`dramerge`), ComputeDomains'
channel templates (`computedomains`) and what hand-written claim templates and pre-made claims ask
(`templateasks`). May import `gputopo.extender.state` and the wire types.
"""
