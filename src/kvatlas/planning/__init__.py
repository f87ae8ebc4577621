"""Planning: what fits. A model (`model`, presets), its row formats (`formats`), the serving
options (`options`), the buffer map (`buffers`), the planner (`planner`: budget -> Plan) and the
capacity report (`capacity`). Pure Python: nothing here imports torch, numpy, rich or matplotlib,
so `kvatlas plan` starts fast."""
