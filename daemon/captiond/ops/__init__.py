"""Operating the process: systemd notification and units, logging, metrics, memory trimming and
the event loop's choice. Leaf modules any layer above may use; they import nothing of the
package but `errors`.
"""
