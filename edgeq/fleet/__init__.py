"""Devices over SSH: an inventory, one transport interface, push, remote profile and verify.

Host side only. Nothing here imports paramiko (the ``deploy`` extra) or TensorFlow at
import time; ``edgeq.fleet.ssh.SSHTransport`` loads paramiko when it connects.
``edgeq.fleet.device`` is the small part that runs on the device.
"""
