package policy

import (
	"slices"

	"go.yaml.in/yaml/v3"
)

// Effective returns c as YAML, every default filled in, in the file's own
// key order and spelling (10s, 16MiB): what GET /v1/config shows. Each
// listener keeps only the section of its own kind (upstream, transparent,
// pool or ingress), so that the output parses back to c.
func (c Config) Effective() ([]byte, error) {
	c.Listeners = slices.Clone(c.Listeners)
	for i := range c.Listeners {
		if c.Listeners[i].IsIngress() {
			c.Listeners[i].Ingress = c.Listeners[i].Ingress.OrDefaults()
		}
	}
	var root yaml.Node
	if err := root.Encode(c); err != nil {
		return nil, err
	}
	if ls := mapValue(&root, "listeners"); ls != nil {
		for i, item := range ls.Content {
			if i >= len(c.Listeners) {
				break
			}
			l := c.Listeners[i]
			keep := map[string]bool{
				"upstream":    l.Upstream != "",
				"transparent": l.IsTransparent(),
				"pool":        l.IsPool(),
				"ingress":     l.IsIngress(),
			}
			var content []*yaml.Node
			for j := 0; j+1 < len(item.Content); j += 2 {
				if k, kind := keep[item.Content[j].Value]; kind && !k {
					continue
				}
				content = append(content, item.Content[j], item.Content[j+1])
			}
			item.Content = content
		}
	}
	return yaml.Marshal(&root)
}

// mapValue returns the value of key in a mapping node, nil if absent.
func mapValue(n *yaml.Node, key string) *yaml.Node {
	if n.Kind == yaml.DocumentNode && len(n.Content) == 1 {
		n = n.Content[0]
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			return n.Content[i+1]
		}
	}
	return nil
}
