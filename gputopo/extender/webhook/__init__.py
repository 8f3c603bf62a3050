"""The mutating admission webhook: opting a pod in by annotation (`mutation`) and the ResourceClaimTemplates of
gputopo's DRA claims (`claimtemplates`, `templatecheck`). May import `watch`, `state` and the wire types.
"""
