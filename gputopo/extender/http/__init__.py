"""The extender's listeners below the application: the verbs' own HTTP/1.1 server (`verbserver`, with its `framing`,
`pipeline`, `timers` and `dispatch`), uvicorn's protocol under the listener limits for the webhook and metrics
(`uvicornprotocol`, accepted through `gputopo.listenguard.acceptgate`), the refusals that enforce the listener
limits (`refusals`), the request-body limit (`bodylimit`) and who may call /mutate (`clientauth`), what a request's head
decides before any body is read and the body budget (`heads`), and the bounded worker threads that parse reviews off the
listeners' loops (`workers`). Imports only the extender's settings and metrics; knows nothing of decisions.
"""
