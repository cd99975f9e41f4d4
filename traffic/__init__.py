"""gpumigrate.traffic: staged traffic shifting through a real Envoy (see README.md in this folder).

Entry points: :class:`gpumigrate.traffic.ramp.RampController`, :func:`gpumigrate.traffic.state.rollback_to_source`,
:class:`gpumigrate.traffic.xds.ControlPlane`, :class:`gpumigrate.traffic.envoy.Envoy`,
:class:`gpumigrate.traffic.loadgen.LoadGenerator`. Modules are imported lazily by callers, so
importing this package costs nothing (no grpc, no protobuf).
"""
